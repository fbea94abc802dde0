"""PyTorch's operators (a GPU's forward, eager here) scoring B sequences' rows in one batched forward against one
forward per sequence (what LeanModel.forward_many did on the operators before it batched them): the projections
and MLP read each weight once for the batch instead of B times.

    .venv/bin/python bench/operators_batched.py [smollm2-135m] [fp32]

B = 1, 2, 4, 8, 16 sequences at contexts spread over 256..1024, n = 1 and 4 new tokens each; interleaved medians.
"""

from __future__ import annotations

import sys

import torch
from timing import interleaved_medians

from specplan.core.models import load_model
from specplan.decoder.model import ForwardItem, LeanModel, causal_mask
from specplan.profiler.latency import random_cache

CONTEXTS = (256, 512, 768, 1024)


def main(model_name: str, dtype: str) -> None:
    model = LeanModel(load_model(model_name, dtype).transformers_model(), kernels=False)
    calls = {}
    with torch.inference_mode():
        for batch in (1, 2, 4, 8, 16):
            contexts = [CONTEXTS[i % len(CONTEXTS)] for i in range(batch)]
            caches = [random_cache(model, L, 8) for L in contexts]
            for n in (1, 4):
                items = [ForwardItem(torch.randint(0, 1000, (n,)), torch.arange(L, L + n), cache,
                                     causal_mask(L, n, model.dtype, "cpu") if n > 1 else None)
                         for L, cache in zip(contexts, caches)]
                calls[(batch, n, "batched")] = lambda items=items: model._forward_operators(items)
                calls[(batch, n, "per sequence")] = lambda items=items: [model.forward(*item) for item in items]
        measured = interleaved_medians(calls, repeats=9, warmup=2)
    for batch, n, how in calls:
        if how == "batched":
            one, each = measured[(batch, n, "batched")], measured[(batch, n, "per sequence")]
            print(f"B={batch:2d} n={n}: batched {one * 1e3:7.1f} ms, per sequence {each * 1e3:7.1f} ms, "
                  f"{each / one:.2f}x", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(*(sys.argv[1:] or ["smollm2-135m", "fp32"]))
