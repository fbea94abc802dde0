"""bf16 decode steps over a cache that grows as in decoding, with the attended key length bucketed to
KEY_BUCKET (the decoder's default) against exact (a bucket of 1), interleaved per repeat; also at a fixed
context, where bucketing cannot help. Each repeat starts at a context no earlier run has seen (oneDNN caches
the kernels of shapes it has met). Checks that the logits are bit-identical.

    .venv/bin/python bench/key_buckets.py --model smollm2-135m --context 700 --rows 1,13 --steps 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import decoder.model as model_module
from core.machine import cpu_info
from core.models import load_model
from decoder.model import LeanModel, causal_mask


def _steps(lean: LeanModel, cache: model_module.KVCache, context: int, rows: int, steps: int, grow: bool,
           bucket: int) -> tuple[list[float], torch.Tensor]:
    """Seconds per forward of `rows` tokens, the cache advancing by `rows` per step if `grow`."""
    model_module.KEY_BUCKET = bucket
    tokens = torch.arange(100, 100 + rows)
    cache.length = context
    seconds, logits = [], []
    for _ in range(steps):
        positions = torch.arange(cache.length, cache.length + rows)
        mask = causal_mask(cache.length, rows, lean.dtype, "cpu") if rows > 1 else None
        start = time.perf_counter()
        logits.append(lean.forward(tokens, positions, cache, mask))
        seconds.append(time.perf_counter() - start)
        if grow:
            cache.length += rows
    return seconds, torch.cat(logits)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--rows", default="1,13")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lean = LeanModel(load_model(args.model, "bf16").model)
    default = model_module.KEY_BUCKET
    print(f"machine: {cpu_info()['cpu']}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.model} bf16, from context {args.context}, {args.repeats} runs of {args.steps} steps each, "
          f"median step")
    print(f"| rows | cache | exact keys ms | keys bucketed to {default} ms | exact / bucketed | identical |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        for grow in (True, False):
            span = rows * args.steps + default
            cache = lean.new_cache(args.context + args.repeats * span)
            cache.k.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
            cache.v.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
            exact, bucketed, identical = [], [], True
            for repeat in range(args.repeats):
                context = args.context + repeat * span + rows  # a new start: shapes no earlier run has met
                seconds, exact_logits = _steps(lean, cache, context, rows, args.steps, grow, 1)
                exact += seconds
                seconds, bucketed_logits = _steps(lean, cache, context, rows, args.steps, grow, default)
                bucketed += seconds
                identical &= torch.equal(exact_logits, bucketed_logits)
            exact_ms, bucketed_ms = statistics.median(exact) * 1e3, statistics.median(bucketed) * 1e3
            print(f"| {rows} | {'grows' if grow else 'fixed'} | {exact_ms:.2f} | {bucketed_ms:.2f} "
                  f"| {exact_ms / bucketed_ms:.2f} | {identical} |")
    model_module.KEY_BUCKET = default


if __name__ == "__main__":
    main()
