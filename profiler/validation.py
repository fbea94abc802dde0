"""The GPU cost model (profiler/roofline.py) against what was measured: every measured GPU profile in the
repository priced by the model fitted without it (leave one out), and published decode latencies. bench/
modeled_vs_measured.py prints the tables (BENCHMARKS.md); tests/test_checks.py holds them to their bounds."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from specplan.core.profile_schema import load_profile
from specplan.decoder.model import ModelShape
from specplan.profiler import roofline
from specplan.profiler.calibration import MeasuredGpuProfile, fit, read_measured
from specplan.profiler.operators import gpu_operators

SIZES_CHECKED = 64  # t(n)/t(1) is checked for n <= 64: the trees plans run on a GPU
# A held-out profile is checked against a fit to at least this many others of its GPU: the fit has some forty
# parameters, and two profiles of two contexts each leave it to its prior (the H200's three batched profiles)
MIN_CALIBRATION_PROFILES = 3
# Measured with code that is not today's where it matters to the model: kept for the plans solved on them.
SUPERSEDED = {
    "smollm2-135m.h100.bf16.yaml": "measured before multi-row attention ran as grouped matmuls (aca611c), so its "
    "2-64-row curve is another attention path's",
}


def measured_gpu_profiles(folder: Path) -> list[str]:
    """The profiles in `folder` measured on a GPU (not modeled), but the superseded ones."""
    found = []
    for path in sorted(folder.glob("*.yaml")):
        if path.name in SUPERSEDED:
            continue
        data = yaml.safe_load(path.read_text())
        if data.get("source") == "measured" and (data.get("hardware") or {}).get("gpu"):
            found.append(str(path))
    return found


@functools.cache
def data_key(path: str) -> tuple[str | None, str | None, str | None]:
    """(GPU, model, dtype): profiles with one key hold the same curve, whatever code version measured it."""
    profile = load_profile(path)
    return roofline.catalogue_name(str(profile.hardware.get("gpu"))), profile.models.get("target"), profile.dtype


def calibration_without(path: str, paths: list[str]) -> list[str]:
    """The profiles of `path`'s GPU that are other data: another model or another dtype."""
    gpu, *data = data_key(path)
    return [other for other in paths if data_key(other)[0] == gpu and list(data_key(other)[1:]) != data]


def _without_context(profile: MeasuredGpuProfile, context: int) -> MeasuredGpuProfile:
    return replace(profile, points=[point for point in profile.points if point[1] != context])


@dataclass(frozen=True)
class HeldOut:
    """One measured context priced by a fit that did not see it."""

    profile: str
    calibrated_on: int  # profiles of other models or dtypes
    context: int
    t1_measured: float
    t1_modeled: float
    worst_ratio_error: float  # the largest |modeled t(n)/t(1) over measured t(n)/t(1) - 1|, 1 < n <= SIZES_CHECKED

    @property
    def t1_error(self) -> float:
        return self.t1_modeled / self.t1_measured - 1


def leave_one_out(paths: list[str], hold_out: str = "profile") -> list[HeldOut]:
    """Each measured context priced by the model fitted without it: without its profile's model and dtype on that GPU
    (`hold_out` "profile"), or without that context of it alone, its other contexts fitted ("context")."""
    profiles = {path: read_measured(path) for path in paths}
    rows = []
    for path, held in profiles.items():
        other_paths = calibration_without(path, paths)
        others = [profiles[other] for other in other_paths]
        same_data = [profiles[other] for other in paths if other not in other_paths
                     and data_key(other)[0] == data_key(path)[0]]  # this profile and its repeats
        if len(others) < MIN_CALIBRATION_PROFILES:
            continue
        curves: dict[int, dict[int, float]] = {}
        for role, context, n, seconds in held.points:
            if role == "target":
                curves.setdefault(context, {})[n] = seconds
        profile_fit = fit(others).parameters if hold_out == "profile" else None
        gpu = roofline.CATALOGUE[held.gpu]
        for context, curve in sorted(curves.items()):
            parameters = profile_fit or fit(others + [_without_context(p, context) for p in same_data]).parameters
            model = {n: roofline.gpu_forward_seconds(held.costs["target"], gpu, parameters, n, context, held.mode)
                     for n in curve}
            ratio_errors = [abs((model[n] / model[1]) / (curve[n] / curve[1]) - 1) for n in curve
                            if 1 < n <= SIZES_CHECKED]
            rows.append(HeldOut(Path(path).name, len(others), context, curve[1], model[1], max(ratio_errors)))
    return rows


@dataclass(frozen=True)
class BatchedStep:
    """One measured step of B sequences, n new tokens each, over `context` cached tokens, against the model."""

    profile: str
    context: int
    batch: int
    n: int
    measured: float
    modeled: float

    @property
    def error(self) -> float:
        return self.modeled / self.measured - 1


def batched_steps(path: str, parameters: roofline.GpuParameters = roofline.DEFAULT_PARAMETERS
                  ) -> list[BatchedStep]:
    """Each batched step (B > 1) a measured profile timed, priced by the model with `parameters` (by default the
    catalogue's, fitted to single-sequence H100 profiles: a profile of another GPU is held out entirely)."""
    measured = read_measured(path)
    profile = load_profile(path)
    gpu, cost = roofline.CATALOGUE[measured.gpu], measured.costs["target"]
    return [BatchedStep(Path(path).name, context, batch, n, seconds,
                        roofline.gpu_forward_seconds(cost, gpu, parameters, n, context, measured.mode, batch))
            for context, batches in sorted(profile.target_batches.items())
            for batch, curve in sorted(batches.items()) if batch > 1
            for n, seconds in sorted(curve.items())]


# Published single-stream decode latencies: (what, GPU, dtype, execution, config, context, ms per token, source)
LLAMA2_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                 num_key_value_heads=32, num_hidden_layers=32, vocab_size=32000, max_position_embeddings=4096)
LLAMA_13B = dict(LLAMA2_7B, hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=40,
                 num_hidden_layers=40)
LLAMA2_7B_128K = dict(LLAMA2_7B, max_position_embeddings=131072)
PUBLISHED = [
    ("gpt-fast Llama-2-7B, 104.9 tok/s", "a100-80g", "bf16", "compiled", LLAMA2_7B, 256, 1e3 / 104.9,
     "pytorch-labs/gpt-fast README (A100 80GB, bf16, torch.compile)"),
    ("vLLM Llama-7B, Dolly 91.04 tok/s", "a100-80g", "fp16", "eager", LLAMA2_7B, 512, 1e3 / 91.04,
     "Lookahead paper, Table 2"),
    ("vLLM Llama-7B, Dolly 32.58 tok/s", "a10", "fp16", "eager", LLAMA2_7B, 512, 1e3 / 32.58,
     "Lookahead paper, Table 2"),
    ("vLLM Llama-13B, Dolly 51.67 tok/s", "a100-80g", "fp16", "eager", LLAMA_13B, 512, 1e3 / 51.67,
     "Lookahead paper, Table 2"),
    ("vLLM Llama-13B, Dolly 22.07 tok/s", "v100", "fp16", "eager", LLAMA_13B, 512, 1e3 / 22.07,
     "Lookahead paper, Table 2"),
    ("TriForce autoregressive Llama2-7B-128K, 122K prompt", "a100-80g", "bf16", "graphs", LLAMA2_7B_128K, 122000,
     108 / 2, "TriForce paper: 0.108 s/token offloaded is 'only half as slow as' the A100 baseline"),
]


def published(parameters: roofline.GpuParameters = roofline.DEFAULT_PARAMETERS) -> list[tuple[Any, ...]]:
    """(what, GPU, dtype, execution, measured ms, modeled ms, source) for each published latency."""
    from transformers import AutoConfig

    rows = []
    for what, gpu_name, dtype, mode, fields, context, ms, source in PUBLISHED:
        fields = dict(fields)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        shape = ModelShape.from_config(config)
        cost = roofline.gpu_model_cost(shape, config.intermediate_size, dtype, gpu_operators(config, dtype))
        modeled = roofline.gpu_forward_seconds(cost, roofline.CATALOGUE[gpu_name], parameters, 1, context, mode) * 1e3
        rows.append((what, gpu_name, dtype, mode, ms, modeled, source))
    return rows
