"""One pass over a model's matmul weights, F.linear against the decoder's weights (prepacked for oneDNN; on a
CPU that emulates bf16, an fp32 copy for matmuls of UPCAST_ROWS rows or more), timed interleaved per row count (best
of 3 sweeps). Reports whether the results are bit-identical, and the largest difference.

    .venv/bin/python bench/matmul.py --model smollm2-135m --dtype bf16 --rows 1,4,12,16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from core.machine import cpu_info
from core.models import load_model
from decoder.model import LeanModel
from profiler.hardware import best_time


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--rows", default="1,4,12,16")
    args = parser.parse_args()
    loaded = load_model(args.model, args.dtype)
    lean = LeanModel(loaded.model)
    if not lean.packed and not lean.emulated_bf16:
        raise SystemExit("this torch build or dtype has no prepacked oneDNN path")
    params = dict(loaded.model.named_parameters())
    plain = [p.detach() for name, p in params.items() if name.endswith("proj.weight")]
    plain.append(lean.lm_head)
    packed = [lean._matmul_weight(w) for w in plain]
    print(f"machine: {cpu_info()['cpu']}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.model} {args.dtype}, {len(plain)} weight matrices, emulated bf16: {lean.emulated_bf16}")
    print("| rows | F.linear ms | decoder ms | F.linear / decoder | identical | max abs difference |")
    print("|---|---|---|---|---|---|")
    for n in (int(r) for r in args.rows.split(",")):
        x = {w.shape[1]: torch.randn(n, w.shape[1], dtype=lean.dtype) for w in plain}
        linear = best_time(lambda x=x: [F.linear(x[w.shape[1]], w) for w in plain], 3)
        prepacked = best_time(lambda x=x: [lean._linear(x[w.shape[1]], p) for w, p in zip(plain, packed)], 3)
        pairs = [(F.linear(x[w.shape[1]], w), lean._linear(x[w.shape[1]], p)) for w, p in zip(plain, packed)]
        identical = all(torch.equal(a, b) for a, b in pairs)
        difference = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
        print(f"| {n} | {linear * 1e3:.2f} | {prepacked * 1e3:.2f} | {linear / prepacked:.2f} | {identical} | "
              f"{difference:.3g} |")


if __name__ == "__main__":
    main()
