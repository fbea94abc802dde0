"""Backs the GPU cost model's defaults (profiler/roofline.py: DEFAULT_PARAMETERS, fitted by --fit to every measured
H100 profile) and prints its validation (profiler/validation.py; tests/test_checks.py holds it to its bounds): every
measured GPU profile in the repository predicted by the model calibrated on the others (leave one out), published
decode latencies, and the decisions the modeled profile leads to.

    .venv/bin/python bench/modeled_vs_measured.py            # the validation tables (BENCHMARKS.md)
    .venv/bin/python bench/modeled_vs_measured.py --fit      # the parameters fitted to all of them (the defaults)
    .venv/bin/python bench/modeled_vs_measured.py --hold-out context   # each context fitted on the rest, its own
                                                                       # profile's other contexts included
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from specplan.core.profile_schema import load_profile
from specplan.planner.lookahead import solve_lookahead
from specplan.planner.triforce import solve_triforce
from specplan.profiler.calibration import config_of, fit, read_measured
from specplan.profiler.latency import ProfileRequest, run_profile
from specplan.profiler.validation import (
    SUPERSEDED,
    batched_steps,
    calibration_without,
    data_key,
    leave_one_out,
    measured_gpu_profiles,
    published,
)


def print_leave_one_out(paths: list[str], hold_out: str) -> None:
    print("| held out | calibrated on | L | t(1) measured | t(1) modeled | t(1) error "
          "| worst t(n)/t(1) error, n <= 64 |")
    print("|---|---|---|---|---|---|---|")
    basis = "other models or dtypes" + ("" if hold_out == "profile" else ", its other contexts")
    for row in leave_one_out(paths, hold_out):
        print(f"| {row.profile} | {row.calibrated_on} of {basis} | {row.context} | {row.t1_measured * 1e3:.2f} ms | "
              f"{row.t1_modeled * 1e3:.2f} ms | {row.t1_error:+.0%} | {row.worst_ratio_error:.1%} |")


def print_published() -> None:
    print("\n| published | GPU, dtype, execution | measured | modeled | error | source |")
    print("|---|---|---|---|---|---|")
    for what, gpu_name, dtype, mode, ms, modeled, source in published():
        print(f"| {what} | {gpu_name}, {dtype}, {mode} | {ms:.2f} ms | {modeled:.2f} ms | {modeled / ms - 1:+.0%} | "
              f"{source} |")


def print_batched(paths: list[str]) -> None:
    """Measured steps of B sequences against the model with its defaults (fitted to single-sequence H100 steps)."""
    for path in paths:
        steps = batched_steps(path)
        if not steps:
            continue
        sizes = sorted({step.n for step in steps})
        print(f"\n{Path(path).name}: t(B, n) measured / modeled, ms (the defaults' fit saw no batched step)\n")
        print("| L | B | " + " | ".join(f"n = {n}" for n in sizes) + " |")
        print("|---|---|" + "---|" * len(sizes))
        cells = {(step.context, step.batch, step.n): step for step in steps}
        for context, batch in sorted({(step.context, step.batch) for step in steps}):
            row = [cells.get((context, batch, n)) for n in sizes]
            print(f"| {context} | {batch} | " + " | ".join(
                "" if step is None else f"{step.measured * 1e3:.1f} / {step.modeled * 1e3:.1f}" for step in row) + " |")
        errors = sorted(abs(step.error) for step in steps)
        print(f"\n{len(steps)} steps: median |error| {errors[len(errors) // 2]:.1%}, worst {errors[-1]:.1%}")


# Decision quality on the H100 data: the plan solved on the modeled profile (calibrated without the measured one),
# priced on the measured profile, against the plan solved on the measured profile. (method, acceptance, context)
DECISIONS = [
    ("lookahead", "acceptance/smollm2-135m.lookahead.specbench-sum-rag-code.fp32.yaml", None),
    ("triforce", "acceptance/smollm2-135m.triforce.haystack.cpu-2c-avx2.fp32.decoded-7680.yaml", 7680),
    ("triforce", "acceptance/smollm2-135m.triforce.haystack.cpu-2c-avx2.fp32.decoded-4096.yaml", 4096),
]
DECISION_PROFILE = str(Path("profiles/smollm2-135m.h100-grouped-attention.fp32.yaml"))


def modeled_like(measured_path: str, calibration: list[str], directory: Path) -> Path:
    """The profile `measured_path` would be if modeled: same model (its config from the fingerprint), dtype,
    contexts and sizes, the cost model fitted to `calibration`."""
    measured = load_profile(measured_path)
    fingerprint = measured.raw["model_fingerprints"]["target"]
    config_dir = directory / fingerprint["name"]
    config_dir.mkdir(parents=True, exist_ok=True)
    config_of(fingerprint).to_json_file(config_dir / "config.json")
    output = directory / "modeled.yaml"
    contexts = sorted(measured.target_by_context)
    request = ProfileRequest(target=str(config_dir), dtype=measured.dtype or "fp32",
                             gpu=read_measured(measured_path).gpu, contexts=contexts,
                             sizes=sorted(measured.target_by_context[contexts[0]]), calibrate=calibration,
                             # the catalogue's defaults were fitted to the held-out profile too: no pull towards them
                             calibration_prior_weight=0.0)
    run_profile(request, output, log=lambda message: None)
    return output


def setting(method: str, candidate) -> tuple:
    if method == "lookahead":
        return candidate.decoding_length, candidate.branch_length
    return candidate.gamma1, candidate.gamma2, candidate.budget, candidate.chunk, candidate.stride, candidate.streaming


def decisions(paths: list[str]) -> None:
    print("\n| method | plan solved on the modeled profile | its speedup priced on the measured profile | plan solved "
          "on the measured profile | its speedup | modeled choice / measured choice |")
    print("|---|---|---|---|---|---|")
    calibration = calibration_without(DECISION_PROFILE, paths)
    with tempfile.TemporaryDirectory() as scratch:
        modeled = modeled_like(DECISION_PROFILE, calibration, Path(scratch))
        for method, acceptance, context in DECISIONS:
            if method == "lookahead":
                _, on_measured = solve_lookahead(acceptance, DECISION_PROFILE)
                _, on_modeled = solve_lookahead(acceptance, modeled)
            else:
                _, on_measured = solve_triforce(acceptance, DECISION_PROFILE, context)
                _, on_modeled = solve_triforce(acceptance, modeled, context)
            priced = {setting(method, c): c.speedup for c in on_measured}
            chosen, best = setting(method, on_modeled[0]), on_measured[0]
            label = f"{method}" + (f" {context}" if context else "")
            print(f"| {label} | {chosen} | {priced[chosen]:.3f}x | {setting(method, best)} | {best.speedup:.3f}x | "
                  f"{priced[chosen] / best.speedup:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fit", action="store_true", help="print the parameters fitted to every measured profile")
    parser.add_argument("--hold-out", choices=("profile", "context"), default="profile",
                        help="what each check's fit leaves out: the held-out profile's model and dtype on that GPU, "
                        "or the one context checked (its other contexts fitted; 36 fits, about 5 minutes)")
    args = parser.parse_args()
    paths = measured_gpu_profiles(Path("profiles"))
    if args.fit:
        calibration = fit([read_measured(p, "h100") for p in paths if data_key(p)[0] == "h100"])
        for name, value in calibration.parameters.as_dict().items():
            print(f"{name}={value:.3g}")
        print(f"rms log error {calibration.rms_log_error:.3f}, worst {calibration.worst_error:.1%}")
        return
    print(f"measured GPU profiles: {', '.join(paths)}")
    print("".join(f"left out: {path}, {why}\n" for path, why in SUPERSEDED.items()))
    print_leave_one_out(paths, args.hold_out)
    print_published()
    print_batched(paths)
    decisions(paths)


if __name__ == "__main__":
    main()
