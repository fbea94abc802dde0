"""What a calibration's pull towards the catalogue (profiler/calibration.py: CALIBRATION_PRIOR_WEIGHT) does when one
measured profile is all a user has: calibrate on one H100 profile of model A, price every H100 profile of another
model B, for each pair. The pull's centre is the model fitted without B's profiles (the defaults saw B: a leak).

    .venv/bin/python bench/calibration_prior.py --weights 0,0.3     # 8.5 minutes for these two on cpu-2c
"""

from __future__ import annotations

import argparse

import numpy as np
from modeled_vs_measured import data_key, measured_gpu_profiles

from specplan.profiler import roofline
from specplan.profiler.calibration import MeasuredGpuProfile, fit, read_measured


def rms_log_error(profile: MeasuredGpuProfile, parameters: roofline.GpuParameters) -> float:
    return float(np.sqrt(np.mean(np.log(profile.predicted(parameters) / profile.measured()) ** 2)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", default="0,0.3", help="prior weights, comma-separated")
    args = parser.parse_args()
    weights = [float(w) for w in args.weights.split(",")]
    paths = measured_gpu_profiles()
    profiles = {path: read_measured(path) for path in paths}
    errors: dict[str, list[float]] = {"no calibration (the centre)": [], **{f"weight {w:g}": [] for w in weights}}
    for model in sorted({data_key(path)[1] for path in paths}):
        held = [profiles[path] for path in paths if data_key(path)[1] == model]
        others = [path for path in paths if data_key(path)[1] != model]
        centre = fit([profiles[path] for path in others]).parameters
        errors["no calibration (the centre)"] += [rms_log_error(profile, centre) for profile in held]
        for one in others:
            for weight in weights:
                parameters = fit([profiles[one]], base=centre, prior_weight=weight).parameters
                errors[f"weight {weight:g}"] += [rms_log_error(profile, parameters) for profile in held]
    print("| calibrated on one profile of another model | pairs | rms log error: mean | median | worst |")
    print("|---|---|---|---|---|")
    for label, values in errors.items():
        array = np.array(values)
        print(f"| {label} | {len(array)} | {array.mean():.3f} | {np.median(array):.3f} | {array.max():.3f} |")


if __name__ == "__main__":
    main()
