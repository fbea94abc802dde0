"""t(B, n) a `--batches` profile measured on a GPU against the same config's modeled profile for that GPU: the
modeled / measured ratio at every batched point both have.

    python bench/batched_modeled_vs_measured.py MEASURED.yaml MODELED.yaml

Model the GPU with the measured profile's contexts, sizes and batches (`plan profile --target CONFIG.json --gpu
NAME --dtype bf16 --contexts ... --sizes ... --batches ...`), then run this.
"""

from __future__ import annotations

import sys

import numpy as np

from specplan.core.profile_schema import load_profile


def main(measured_path: str, modeled_path: str) -> None:
    measured, modeled = load_profile(measured_path), load_profile(modeled_path)
    ratios = []
    for context in sorted(set(measured.target_batches) & set(modeled.target_batches)):
        for batch in sorted(set(measured.target_batches[context]) & set(modeled.target_batches[context])):
            points = measured.target_batches[context][batch]
            line = []
            for n in sorted(set(points) & set(modeled.target_batches[context][batch])):
                ratio = modeled.target_batches[context][batch][n] / points[n]
                ratios.append(ratio)
                line.append(f"n={n} {points[n] * 1e3:.2f} ms x{ratio:.2f}")
            print(f"L={context} B={batch}: " + ", ".join(line), flush=True)
    if not ratios:
        raise SystemExit("the two profiles share no batched point")
    errors = np.abs(np.log(ratios))
    print(f"{len(ratios)} points: modeled/measured {min(ratios):.2f}-{max(ratios):.2f}, "
          f"within 20%: {int(np.sum(errors <= np.log(1.2)))}, rms log error {float(np.sqrt(np.mean(errors ** 2))):.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
