"""On a GPU: one forward of n new tokens over L cached ones, replayed as a CUDA graph (the profiler's static
layout), with attention through SDPA against the grouped matmuls (LeanModel._attention), forced for 2 to 64
rows here whatever the dtype and key count. Each point alternates the two, median of --repeats replays each.

    python bench/gpu_attention.py --model smollm2-135m --dtype fp32 --contexts 256,1024,4096,7680
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specplan.core.models import load_model
from specplan.decoder.model import LeanModel
from specplan.profiler.latency import _cuda_graph_call


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--contexts", default="256,1024,4096,7680")
    parser.add_argument("--sizes", default="1,2,4,16,32,48,64")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    loaded = load_model(args.model, args.dtype)
    grouped, sdpa = LeanModel(loaded.model, "cuda"), LeanModel(loaded.model, "cuda")
    sdpa._grouped_attention = lambda n, keys: False
    grouped._grouped_attention = lambda n, keys: 2 <= n <= 64
    sizes = [int(n) for n in args.sizes.split(",")]
    print(f"{args.model} {args.dtype} on {torch.cuda.get_device_name(0)}: ms per forward (median of {args.repeats})")
    print("    L    n    sdpa  grouped  sdpa/grouped")
    for context in (int(c) for c in args.contexts.split(",")):
        for n in sizes:
            calls = []
            for model in (sdpa, grouped):
                cache = model.new_cache(context + n)
                cache.k.normal_(0, 0.1)
                cache.v.normal_(0, 0.1)
                cache.length = context
                tokens = torch.randint(0, model.shape.vocab, (n,), device="cuda")
                calls.append(_cuda_graph_call(model, cache, tokens, torch.arange(context, context + n, device="cuda"),
                                              torch.cuda.graph_pool_handle()))
            times = [[], []]
            for _ in range(args.repeats):
                for i, call in enumerate(calls):
                    times[i].append(call())
            a, b = (statistics.median(t) * 1e3 for t in times)
            print(f"{context:5d} {n:4d} {a:7.2f} {b:8.2f} {a / b:12.2f}")


if __name__ == "__main__":
    main()
