"""Fitting a GPU's cost-model parameters (profiler/roofline.py: GpuParameters) to profiles measured on it, and
pricing a measured profile's models on the model: `plan profile --gpu NAME --calibrate MEASURED.yaml ...` and
bench/modeled_vs_measured.py."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from specplan.core.errors import UserError
from specplan.core.profile_schema import LatencyProfile, load_profile
from specplan.decoder.model import ModelShape
from specplan.profiler import roofline
from specplan.profiler.operators import gpu_operators

# the parameters a calibration fits (eager_op_seconds needs profiles of an eager forward, which this decoder
# does not measure on a GPU), each within bounds that keep it physical
FITTED = {
    "op_seconds": (0.5e-6, 20e-6),
    "op_row_seconds": (0.0, 1e-7),
    "bandwidth_efficiency": (0.3, 1.0),
    **{f"gemm_efficiency_{kind}_rows{rows}": (0.01, 1.0)
       for kind in ("fp32", "tensor") for rows in roofline.ROW_BUCKETS},
    "gemm_split_depth_fp32": (128, 1e6),
    "gemm_split_depth_tensor": (128, 1e6),
    **{f"gemm_floor_seconds_{kind}_rows{rows}": (0.5e-6, 100e-6)
       for kind in ("fp32", "tensor") for rows in roofline.ROW_BUCKETS},
    "attention_flops_fp32": (1e10, 1e14),
    "attention_key_seconds_grouped_fp32": (0.0, 1e-6),
    "attention_key_seconds_grouped_tensor": (0.0, 1e-6),
    "attention_key_seconds_masked_fp32": (0.0, 1e-6),
    "attention_key_seconds_masked_tensor": (0.0, 1e-6),
    "attention_key_dim_seconds_masked_fp32": (0.0, 1e-8),
    "attention_key_dim_seconds_masked_tensor": (0.0, 1e-8),
    **{f"attention_score_seconds_{path}_{kind}": (0.0, 1e-9) for path in ("grouped", "masked")
       for kind in ("fp32", "tensor")},
}
# A calibration's pull towards the catalogue's parameters: a residual of this weight per unit of log distance, so
# that what its few profiles leave undetermined stays at the defaults. Measured (bench/calibration_prior.py): one
# H100 profile alone, unweighted, priced the other models' points at an rms log error of 0.51 (worst 2.2); at 0.3,
# 0.063 (worst 0.14).
CALIBRATION_PRIOR_WEIGHT = 0.3
FITTED_SIZES = 128  # the points fitted: plans use n up to a few hundred at most, most below 64
MODES = {"lean": "graphs", "compiled": "compiled", "transformers": "eager"}  # a measured profile's backend


def config_of(fingerprint: dict[str, Any]) -> Any:
    """A transformers config with the sizes a profile's model fingerprint records."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        fingerprint["architecture"], hidden_size=fingerprint["hidden_size"],
        num_hidden_layers=fingerprint["layers"], num_attention_heads=fingerprint["attention_heads"],
        num_key_value_heads=fingerprint["kv_heads"], head_dim=fingerprint["head_dim"],
        intermediate_size=fingerprint["intermediate_size"], vocab_size=fingerprint["vocab_size"],
        max_position_embeddings=fingerprint["max_context"], tie_word_embeddings=fingerprint["tie_word_embeddings"])


@dataclass
class MeasuredGpuProfile:
    """A measured profile as the cost model sees it: each timed forward, with what its models cost."""

    path: str
    gpu: str
    mode: str
    costs: dict[str, roofline.GpuModelCost]  # by role
    points: list[tuple[str, int, int, float]]  # (role, context, n, seconds)
    engine_overhead: dict[int, float]

    def predicted(self, parameters: roofline.GpuParameters) -> np.ndarray:
        gpu = roofline.CATALOGUE[self.gpu]
        return np.array([roofline.gpu_forward_seconds(self.costs[role], gpu, parameters, n, context, self.mode)
                         for role, context, n, _ in self.points])

    def measured(self) -> np.ndarray:
        return np.array([seconds for *_, seconds in self.points])


def read_measured(path: str | Path, gpu: str | None = None) -> MeasuredGpuProfile:
    """A measured GPU profile; `gpu`: the catalogue GPU it must have been measured on."""
    profile: LatencyProfile = load_profile(path)
    device = profile.hardware.get("gpu")
    if profile.source != "measured" or not device:
        raise UserError(f"{path}: a calibration needs a profile measured on a GPU (this one is "
                        f"{profile.source}{'' if device else ', on a CPU'})")
    name = roofline.catalogue_name(str(device))
    if name is None:
        raise UserError(f"{path}: measured on {device}, which is not in the GPU catalogue")
    if gpu is not None and name != gpu:
        raise UserError(f"{path}: measured on {device} ({name}), not on {gpu}")
    fingerprints = profile.raw.get("model_fingerprints", {})
    dtypes = {"target": profile.dtype or "fp32", "draft": profile.draft_dtype or profile.dtype or "fp32"}
    costs, points = {}, []
    for role in ("target", "draft"):
        if role not in fingerprints or (role == "draft" and not profile.draft_by_context):
            continue
        config = config_of(fingerprints[role])
        shape = ModelShape.from_config(config)
        rows = profile.draft_vocab if role == "draft" and profile.draft_vocab else None
        costs[role] = roofline.gpu_model_cost(shape, config.intermediate_size, dtypes[role],
                                              gpu_operators(config, dtypes[role]), rows)
    for context, curve in profile.target_by_context.items():
        points += [("target", context, n, seconds) for n, seconds in curve.items() if n <= FITTED_SIZES]
    if "draft" in costs:
        points += [("draft", context, 1, seconds) for context, seconds in profile.draft_by_context.items()]
    return MeasuredGpuProfile(str(path), name, MODES.get(profile.backend, "graphs"), costs, points,
                              dict(profile.overhead_seconds))


@dataclass
class Calibration:
    parameters: roofline.GpuParameters
    files: list[str]
    rms_log_error: float  # root mean square of log(modeled / measured) over every point fitted
    worst_error: float  # largest |modeled / measured - 1|
    engine_overhead: dict[int, float]  # {n: seconds}, the mean of the profiles'

    def record(self) -> dict[str, Any]:
        return {"files": self.files, "parameters": self.parameters.as_dict(), "points_rms_log_error":
                round(self.rms_log_error, 4), "points_worst_relative_error": round(self.worst_error, 4)}


def fit(profiles: list[MeasuredGpuProfile], base: roofline.GpuParameters = roofline.DEFAULT_PARAMETERS,
        prior_weight: float = 0.0) -> Calibration:
    """Least squares on log(modeled / measured) over every point of `profiles` (all of one GPU), the FITTED
    parameters moved in log space within their bounds; the others stay at `base`'s. Each fitted parameter's log
    distance from `base` adds a residual of `prior_weight` times it."""
    from scipy.optimize import least_squares

    names = list(FITTED)
    low = np.array([max(FITTED[name][0], 1e-12) for name in names])
    high = np.array([FITTED[name][1] for name in names])
    start = np.clip(np.array([getattr(base, name) for name in names]), low * 1.0001, high * 0.9999)
    measured = np.concatenate([p.measured() for p in profiles])

    def parameters(x: np.ndarray) -> roofline.GpuParameters:
        return replace(base, **dict(zip(names, np.exp(x).tolist())))

    def errors(x: np.ndarray) -> np.ndarray:
        return np.log(np.concatenate([p.predicted(parameters(x)) for p in profiles]) / measured)

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.concatenate([errors(x), prior_weight * (x - np.log(start))]) if prior_weight else errors(x)

    result = least_squares(residuals, np.log(start), bounds=(np.log(low), np.log(high)), x_scale=1.0)
    fitted = parameters(result.x)
    point_errors = errors(result.x)
    overheads: dict[int, list[float]] = {}
    for profile in profiles:
        for n, seconds in profile.engine_overhead.items():
            overheads.setdefault(n, []).append(seconds)
    return Calibration(fitted, [p.path for p in profiles], float(np.sqrt(np.mean(point_errors ** 2))),
                       float(np.max(np.abs(np.expm1(point_errors)))),
                       {n: float(np.mean(values)) for n, values in sorted(overheads.items())})


def calibrate(gpu: str, paths: list[str], prior_weight: float = CALIBRATION_PRIOR_WEIGHT) -> Calibration:
    """`plan profile --gpu NAME --calibrate ...`: the catalogue's parameters refitted to measured profiles of NAME."""
    return fit([read_measured(path, gpu) for path in paths], prior_weight=prior_weight)
