"""Does torch.compile speed up the lean forward on this machine? Eager against compiled, side by side.

Times LeanModel.forward for n new tokens (n = 1: a decode step; larger n: a token tree) while the cache
grows by one token per call, as in decoding (so the compiled forward must serve changing lengths), and
reports the median step of each, the compile time, and the largest logit difference between the two.

    .venv/bin/python bench/compile.py --model smollm2-135m --dtype bf16 --sizes 1,4,12
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from core.machine import cpu_info
from core.models import load_model
from decoder.model import KVCache, LeanModel, causal_mask


def _prefilled(model: LeanModel, context: int, room: int) -> KVCache:
    cache = model.new_cache(context + room)
    model.prefill(torch.arange(100, 100 + context) % model.shape.vocab, cache, logits=False)
    return cache


def _step(forward: Callable[..., torch.Tensor], model: LeanModel, cache: KVCache,
          tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    n = tokens.shape[0]
    positions = torch.arange(cache.length, cache.length + n)
    mask = causal_mask(cache.length, n, model.dtype, model.device) if n > 1 else None
    start = time.perf_counter()
    logits = forward(tokens, positions, cache, mask)
    seconds = time.perf_counter() - start
    cache.commit(None, 1)
    return seconds, logits


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--sizes", default="1,4,12")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    model = LeanModel(load_model(args.model, args.dtype).model)
    compiled = torch.compile(model.forward, dynamic=True)
    print(f"machine: {cpu_info()['cpu']}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.model} {args.dtype}, context {args.context}, {args.repeats} steps per size")
    print("| n | eager ms | compiled ms | compiled / eager | first compiled call s | max logit diff |")
    print("|---|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        tokens = torch.arange(7, 7 + n)
        eager_cache = _prefilled(model, args.context, args.repeats + n + 8)
        compiled_cache = _prefilled(model, args.context, args.repeats + n + 8)
        start = time.perf_counter()
        for _ in range(3):  # compiles, and recompiles once the length changes
            _step(compiled, model, compiled_cache, tokens)
        compile_seconds = time.perf_counter() - start
        for _ in range(3):
            _step(model.forward, model, eager_cache, tokens)
        eager_times, compiled_times = [], []
        for _ in range(args.repeats):  # interleaved, so that the machine's drift hits both alike
            seconds, eager_logits = _step(model.forward, model, eager_cache, tokens)
            eager_times.append(seconds)
            seconds, compiled_logits = _step(compiled, model, compiled_cache, tokens)
            compiled_times.append(seconds)
        eager_ms = statistics.median(eager_times) * 1e3
        compiled_ms = statistics.median(compiled_times) * 1e3
        diff = (eager_logits.float() - compiled_logits.float()).abs().max().item()
        print(f"| {n} | {eager_ms:.2f} | {compiled_ms:.2f} | {compiled_ms / eager_ms:.2f} | {compile_seconds:.1f} "
              f"| {diff:.3g} |")


if __name__ == "__main__":
    main()
