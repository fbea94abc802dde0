"""The CPU kernels' tuning constants, measured: the kernels built with other -D values (TILE_W x TILE_X, the
register tile for more than 4 rows; PREFETCH_BYTES, how far ahead a block-format row is requested; GEMM_ROWS, the
query rows per KV head from which attention scores a chunk with one GEMM) timed on whole passes over real weights,
against oneDNN's packed matmul, and on attention over a long cache.

    .venv/bin/python bench/kernel_variants.py tiles 8x2 4x4 6x4 2x8 12x2      # fp32/bf16 passes, smollm2-135m
    .venv/bin/python bench/kernel_variants.py prefetch 1024 2048 4096 8192     # Q4_K/Q6_K one-row, qwen2.5-coder-1.5b
    .venv/bin/python bench/kernel_variants.py attention 2 4 8                  # smollm2's and qwen's head groups

A pass runs every layer's matmul once (q/k/v fused, o, gate/up fused, down) for n activation rows: 540 MB of
fp32 weights, more than the caches hold, so each pass streams from memory as a forward does.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial

import numpy as np
import torch
from torch.utils.cpp_extension import load

from core.models import load_model, preset_gguf
from decoder.cpu_kernels import FLAGS, SOURCE, WEIGHT_FORMATS

REPEATS = 15


def median_seconds(work) -> float:
    for _ in range(3):
        work()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(defines: dict[str, str]):
    name = "variant_" + "_".join(f"{key}{value}" for key, value in defines.items())
    return load(name=name, sources=[str(SOURCE)],
                extra_cflags=FLAGS + ["-march=native"] + [f"-D{k}={v}" for k, v in defines.items()],
                extra_ldflags=["-fopenmp"], verbose=False)


def layer_matrices() -> list[torch.Tensor]:
    params = dict(load_model("smollm2-135m", "fp32").model.named_parameters())
    matrices = []
    for i in range(30):
        prefix = f"model.layers.{i}."
        weight = {name: params[prefix + name + ".weight"].detach() for name in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")}
        matrices += [torch.cat([weight[f"self_attn.{p}_proj"] for p in "qkv"]), weight["self_attn.o_proj"].clone(),
                     torch.cat([weight["mlp.gate_proj"], weight["mlp.up_proj"]]), weight["mlp.down_proj"].clone()]
    return [m.contiguous() for m in matrices]


def pass_seconds(matmul, weights: list, inputs: dict) -> float:
    """Median seconds of one pass: matmul(x, weight) for every weight, x the input of its width."""
    return median_seconds(lambda: [matmul(inputs[w.shape[-1]], w) for w in weights])


def kernel_matmul(kernels, kind: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return kernels.linear(x, WEIGHT_FORMATS[kind], weight, None, weight.shape[0])


def onednn_matmul(packed: dict, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed[id(weight)], None, "none", [], "")


def block_pass(kernels, kind: str, matrices: list[tuple[torch.Tensor, int]]) -> None:
    """One row through every (GGUF blocks [rows, bytes], columns) matrix."""
    for data, cols in matrices:
        kernels.linear(torch.ones(1, cols), WEIGHT_FORMATS[kind], data, None, data.shape[0])


def tiles(shapes: list[str]) -> None:
    matrices = layer_matrices()
    for dtype, kind in ((torch.float32, "F32"), (torch.bfloat16, "BF16")):
        weights = [m.to(dtype) for m in matrices]
        packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights}
        variants = {shape: build(dict(zip(("TILE_W", "TILE_X"), shape.split("x")))) for shape in shapes}
        matmuls = {shape: partial(kernel_matmul, run, kind) for shape, run in variants.items()}
        matmuls["oneDNN packed"] = partial(onednn_matmul, packed)
        for label, matmul in matmuls.items():
            cells = []
            for n in (1, 8, 16, 64):
                inputs = {w.shape[1]: torch.randn(n, w.shape[1], dtype=dtype) for w in weights}
                cells.append(f"n={n} {pass_seconds(matmul, weights, inputs) * 1e3:.1f} ms")
            print(f"{kind} {label}: {', '.join(cells)}", flush=True)


def prefetch(distances: list[str]) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(preset_gguf("qwen2.5-coder-1.5b")))
    streams = {}
    for kind in ("Q4_K", "Q6_K"):
        tensors = [t for t in reader.tensors if t.tensor_type.name == kind and ".ffn_" in t.name][:12]
        streams[kind] = [(torch.from_numpy(np.array(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)),
                          int(t.shape[0])) for t in tensors]
    for distance in distances:
        kernels = build({"PREFETCH_BYTES": distance})
        cells = []
        for kind, matrices in streams.items():
            seconds = median_seconds(partial(block_pass, kernels, kind, matrices))
            cells.append(f"{kind} {sum(d.numel() for d, _ in matrices) / seconds / 1e9:.1f} GB/s")
        print(f"PREFETCH_BYTES={distance}: {', '.join(cells)}", flush=True)


ATTENTION_SHAPES = ((9, 3, 1), (9, 3, 2), (9, 3, 3), (12, 2, 1), (12, 2, 2))  # (heads, KV heads, new tokens)


def attention(thresholds: list[str]) -> None:
    """One layer's attention of n new tokens over 256, 4096 and 7680 cached keys (fp32 cache, head size 64)."""
    for threshold in thresholds:
        kernels = build({"GEMM_ROWS": threshold})
        cells = []
        for heads, kv_heads, n in ATTENTION_SHAPES:
            for length in (256, 4096, 7680):
                q = torch.randn(heads, n, 64)
                keys, values = torch.randn(kv_heads, 8192, 64), torch.randn(kv_heads, 8192, 64)
                mask = torch.zeros(n, length) if n > 1 else None
                seconds = median_seconds(partial(kernels.attention, q, keys, values, length, mask, 0.125))
                cells.append(f"{heads}/{kv_heads} n={n} L={length} {seconds * 1e3:.3f}")
        print(f"GEMM_ROWS={threshold}: {', '.join(cells)} (ms)", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    {"tiles": tiles, "prefetch": prefetch, "attention": attention}[sys.argv[1]](sys.argv[2:])
