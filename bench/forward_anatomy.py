"""Where a one-token forward's time goes (issue 33's starting point): the whole forward against its weight matmuls
alone (the same packed weights, the same calls, one row), and the operators it dispatches.

    .venv/bin/python bench/forward_anatomy.py [smollm2-135m] [fp32,bf16]
"""

from __future__ import annotations

import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.models import load_model
from decoder.api import load_forward

CONTEXT = 500
REPEATS = 40


class OperatorCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def seconds_per_call(work, repeats: int = REPEATS) -> float:
    for _ in range(5):
        work()
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - start) / repeats


@torch.inference_mode()
def anatomy(model_name: str, dtype: str) -> str:
    model = load_forward(load_model(model_name, dtype), "cpu")
    cache = model.new_cache(CONTEXT + 8)
    model.prefill(torch.randint(0, 1000, (CONTEXT,), generator=torch.Generator().manual_seed(0)), cache, logits=False)
    token, position = torch.tensor([5]), torch.tensor([cache.length])
    row = torch.randn(1, model.shape.hidden, dtype=model.dtype)

    def matmuls() -> None:
        for layer in model.layers:
            model._linear(row, layer["wqkv"], layer["bqkv"])
            model._linear(row, layer["wo"], layer["bo"])
            gate_up = model._linear(row, layer["w_gate_up"], layer["b_gate_up"])
            model._linear(gate_up[:, :gate_up.shape[1] // 2].contiguous(), layer["w_down"], layer["b_down"])
        model._linear(row, model.output_weight)

    whole = seconds_per_call(lambda: model.forward(token, position, cache, None))
    weights = seconds_per_call(matmuls)
    counter = OperatorCount()
    with counter:
        model.forward(token, position, cache, None)
    return (f"{model_name} {dtype}: one-token forward at {CONTEXT} tokens {whole * 1e3:.1f} ms; its weight matmuls "
            f"alone {weights * 1e3:.1f} ms ({weights / whole:.0%}); {counter.count} operators per forward, "
            f"{(whole - weights) / counter.count * 1e6:.1f} us each outside the matmuls")


if __name__ == "__main__":
    torch.set_num_threads(2)
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    for dtype in (sys.argv[2] if len(sys.argv) > 2 else "fp32,bf16").split(","):
        print(anatomy(name, dtype))
