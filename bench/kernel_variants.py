"""Backs the CPU kernels' tuning constants (decoder/kernels/): TILE_W x TILE_X, the register tile for more than
ROW_TILE activation rows; PREFETCH_BYTES and F32_PREFETCH_BYTES, how far ahead a block-format or fp32 row is
requested; TORCH_GEMM_ROWS, the activation rows from which a matmul runs as torch's GEMM over decoded weight panels;
Q8K_ROW_TILE, the activation rows per pass over a K-quant weight row; AVX2_ROW_TILE and AVX2_BALANCED_PASSES, the same
over an fp32, Q4_1, Q5_0 or Q8_0 row on AVX2 and how a matmul's rows are shared among its passes; X8_ACT_TILE, the
same over 8 interleaved Q4_K rows (and whether to interleave at all), Q4K_X8_ZMM, whether AVX-512 pairs two such
groups in a zmm; ATTENTION_YMM, the attention's register-tiled ymm paths, ATTENTION_PREFETCH_BYTES, how far ahead
they ask for a cache's keys and values (0: not at all), and TILED_GEMM_ROWS and L2_KEYS, where those hand a chunk to
the GEMM and how many keys they take at a time; SDPA_ROWS, the new tokens of one sequence from which a forward
attends through torch's SDPA (PROMPT_ROWS where each decoding row attends alone, ATTENTION_CHUNK its keys per chunk).
The kernels are built with other -D values and timed on whole passes over real weights, and on attention over a long
cache.

    .venv/bin/python bench/kernel_variants.py tiles 8x2 4x4 6x4 2x8 12x2      # fp32/bf16 passes, smollm2-135m
    .venv/bin/python bench/kernel_variants.py prefetch 1024 2048 4096 8192     # Q4_K/Q6_K one-row, qwen2.5-coder-1.5b
    .venv/bin/python bench/kernel_variants.py q8k-tile 4 6 8 [rows=64,512]      # Q4_K/Q6_K rows per pass, the same
    .venv/bin/python bench/kernel_variants.py q4k-x8 X8_ACT_TILE=4,Q4K_X8_ZMM=0 X8_ACT_TILE=4  # Q4_K: file's rows or x8
    .venv/bin/python bench/kernel_variants.py prefill X8_ACT_TILE=2 X8_ACT_TILE=4 [rows=64,512]  # qwen Q4_K_M
    .venv/bin/python bench/kernel_variants.py q5-0 haswell [rows=1,16]          # Q5_0 in its blocks or as Q8_0
    .venv/bin/python bench/kernel_variants.py block-formats haswell            # Q4_0 .. Q8_0 passes, each build
    .venv/bin/python bench/kernel_variants.py row-tile AVX2_ROW_TILE=4,AVX2_BALANCED_PASSES=0 AVX2_ROW_TILE=5  # AVX2
    .venv/bin/python bench/kernel_variants.py prefetch-f32 256 512 4096        # fp32 one-row, smollm2-135m
    .venv/bin/python bench/kernel_variants.py attention ATTENTION_YMM=0 ATTENTION_YMM=1   # NAME=VALUE,...
    .venv/bin/python bench/kernel_variants.py attention-layers TILED_GEMM_ROWS=10 TILED_GEMM_ROWS=1000
    .venv/bin/python bench/kernel_variants.py attention-layers ATTENTION_PREFETCH_BYTES=0 ATTENTION_PREFETCH_BYTES=2048
    .venv/bin/python bench/kernel_variants.py gemm 3 6 12 65 100000            # TORCH_GEMM_ROWS: tiles or torch's GEMM
    .venv/bin/python bench/kernel_variants.py forward AVX2_DIRECT_ROWS_F32=4,TORCH_GEMM_ROWS_F32=5 \
        AVX2_DIRECT_ROWS_F32=16,TORCH_GEMM_ROWS_F32=17 [dtype=gguf rows=16,32 context=7680]   # whole smollm2 forwards

A pass runs every layer's matmul once (q/k/v fused, o, gate/up fused, down) for n activation rows: 540 MB of
fp32 weights, more than the caches hold, so each pass streams from memory as a forward does.
"""

from __future__ import annotations

import sys
from functools import partial

import numpy as np
import torch
from timing import interleaved_medians, median_seconds
from torch.utils.cpp_extension import load

from specplan.core.models import load_model, preset_gguf
from specplan.decoder.cpu_kernels import FLAGS, SOURCE_DIR, SOURCES


def build(defines: dict[str, str]):
    name = "variant_" + "_".join(f"{key}{value}" for key, value in defines.items())
    return load(name=name, sources=[str(SOURCE_DIR / source) for source in SOURCES],
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
    return median_seconds(partial(one_pass, matmul, weights, inputs))


def one_pass(matmul, weights: list, inputs: dict) -> None:
    """One pass: matmul(x, weight) for every weight, x the input of its width."""
    for w in weights:
        matmul(inputs[w.shape[-1]], w)


def kernel_matmul(kernels, kind: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return kernels.linear(x, kind, weight, None, weight.shape[0])


def block_pass(kernels, kind: str, matrices: list[tuple[torch.Tensor, int]], rows: int = 1) -> None:
    """`rows` activation rows through every (GGUF blocks [rows, bytes], columns) matrix."""
    for data, cols in matrices:
        kernels.linear(torch.ones(rows, cols), kind, data, None, data.shape[0])


def tiles(shapes: list[str]) -> None:
    matrices = layer_matrices()
    for dtype, kind in ((torch.float32, "F32"), (torch.bfloat16, "BF16")):
        weights = [m.to(dtype) for m in matrices]
        variants = {shape: build(dict(zip(("TILE_W", "TILE_X"), shape.split("x")))) for shape in shapes}
        matmuls = {shape: partial(kernel_matmul, run, kind) for shape, run in variants.items()}
        matmuls["torch F.linear"] = lambda x, weight: torch.nn.functional.linear(x, weight)
        for label, matmul in matmuls.items():
            cells = []
            for n in (1, 8, 16, 64):
                inputs = {w.shape[1]: torch.randn(n, w.shape[1], dtype=dtype) for w in weights}
                cells.append(f"n={n} {pass_seconds(matmul, weights, inputs) * 1e3:.1f} ms")
            print(f"{kind} {label}: {', '.join(cells)}", flush=True)


def prefetch_f32(distances: list[str]) -> None:
    """One-row passes over smollm2-135m's fp32 layers and output matrix for each F32_PREFETCH_BYTES, interleaved,
    beside torch summing the same weights (the rate the memory gives one pass)."""
    weights = layer_matrices() + [dict(load_model("smollm2-135m", "fp32").model.named_parameters())[
        "model.embed_tokens.weight"].detach().contiguous()]
    inputs = {cols: torch.randn(1, cols) for cols in {w.shape[1] for w in weights}}
    size = sum(w.numel() * w.element_size() for w in weights)
    calls = {f"F32_PREFETCH_BYTES={distance}": partial(one_pass, partial(kernel_matmul, build(
        {"F32_PREFETCH_BYTES": distance}), "F32"), weights, inputs) for distance in distances}
    calls["torch sum"] = lambda: [w.sum() for w in weights]
    for _ in range(2):
        medians = interleaved_medians(calls, repeats=9, warmup=1)
        print(", ".join(f"{label} {size / s / 1e9:.1f} GB/s" for label, s in medians.items()), flush=True)


def k_quant_matrices(kind: str, limit: int | None = None, name_part: str = "", model: str = "qwen2.5-coder-1.5b",
                     layers: bool = True) -> list[tuple[torch.Tensor, int]]:
    """`model`'s `kind` (Q4_K, Q6_K, or any block format) matrices whose names contain `name_part` (the layers', or
    every one), as (GGUF blocks [rows, bytes], columns), the first `limit` of them."""
    from gguf import GGUFReader

    reader = GGUFReader(str(preset_gguf(model)))
    tensors = [t for t in reader.tensors if t.tensor_type.name == kind and (t.name.startswith("blk.") or not layers)
               and name_part in t.name][:limit]
    return [(torch.from_numpy(np.array(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)), int(t.shape[0]))
            for t in tensors]


def row_tile(variants: list[str]) -> None:
    """AVX2_ROW_TILE and AVX2_BALANCED_PASSES (NAME=VALUE,...): passes of n activation rows over the block matrices
    AVX2's direct passes take (smollm2's Q4_1 layers and Q8_0 output, qwen2.5-coder-0.5b's Q5_0 layers), one variant
    each, interleaved; ms per pass."""
    streams = {"Q4_1": k_quant_matrices("Q4_1", model="smollm2-135m"),
               "Q8_0": k_quant_matrices("Q8_0", model="smollm2-135m", layers=False),
               "Q5_0": k_quant_matrices("Q5_0", model="qwen2.5-coder-0.5b")}
    built = {variant: build(dict(item.split("=") for item in variant.split(","))) for variant in variants}
    for kind, matrices in streams.items():
        for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16):
            medians = interleaved_medians({label: partial(block_pass, kernels, kind, matrices, n)
                                           for label, kernels in built.items()}, repeats=9)
            print(f"{kind} n={n}: " + ", ".join(f"{label} {s * 1e3:.2f} ms" for label, s in medians.items()),
                  flush=True)


def prefetch(distances: list[str]) -> None:
    streams = {kind: k_quant_matrices(kind, 12, ".ffn_") for kind in ("Q4_K", "Q6_K")}
    for distance in distances:
        kernels = build({"PREFETCH_BYTES": distance})
        cells = []
        for kind, matrices in streams.items():
            seconds = median_seconds(partial(block_pass, kernels, kind, matrices))
            cells.append(f"{kind} {sum(d.numel() for d, _ in matrices) / seconds / 1e9:.1f} GB/s")
        print(f"PREFETCH_BYTES={distance}: {', '.join(cells)}", flush=True)


def rows_option(variants: list[str], default: str) -> tuple[list[str], list[int]]:
    """The variants without a `rows=1,2,...` item, and the activation rows it names (else `default`'s)."""
    rows = next((v.split("=")[1] for v in variants if v.startswith("rows=")), default)
    return [v for v in variants if not v.startswith("rows=")], [int(n) for n in rows.split(",")]


def q8k_tile(tiles: list[str]) -> None:
    """Every K-quant matrix of qwen2.5-coder-1.5b's layers against n activation rows, per Q8K_ROW_TILE, interleaved
    (rows=16,512: other n than decoding's)."""
    tiles, sizes = rows_option(tiles, "1,2,4,8,16,64")
    matrices = [(kind, data, cols) for kind in ("Q4_K", "Q6_K") for data, cols in k_quant_matrices(kind)]
    variants = {f"Q8K_ROW_TILE={tile}": build({"Q8K_ROW_TILE": tile}) for tile in tiles}

    def run(kernels, inputs: dict) -> None:
        for kind, data, cols in matrices:
            kernels.linear(inputs[cols], kind, data, None, data.shape[0])

    for n in sizes:
        inputs = {cols: torch.randn(n, cols) for _, _, cols in matrices}
        medians = interleaved_medians({t: partial(run, k, inputs) for t, k in variants.items()}, repeats=5, warmup=1)
        print(f"n={n}: " + ", ".join(f"{t} {s * 1e3:.0f} ms" for t, s in medians.items()), flush=True)


def q4k_x8(variants: list[str]) -> None:
    """Every Q4_K matrix of qwen2.5-coder-1.5b's layers against n activation rows: in the file's layout (one row at a
    time, Q8K_ROW_TILE activation rows a pass) and with 8 rows interleaved on each variant (NAME=VALUE,...: X8_ACT_TILE,
    Q4K_X8_ZMM), interleaved in time; the largest difference of their outputs relative to the largest output
    (rows=16,512: other n than decoding's)."""
    from specplan.decoder.cpu_kernels import kernels as host_kernels

    variants, sizes = rows_option(variants, "1,2,4,8,16,64")
    plain = host_kernels()
    matrices = k_quant_matrices("Q4_K")
    calls = {"file rows": lambda inputs: [plain.linear(inputs[cols], "Q4_K", data, None, data.shape[0])
                                          for data, cols in matrices]}
    for variant in variants:
        kernels = build(dict(item.split("=") for item in variant.split(",")))
        packed = []  # each build's own layout (Q4K_X8_ZMM pairs the groups' blocks)
        for data, cols in matrices:
            repacked = kernels.repack("Q4_K", data, data.shape[0], cols)
            if repacked is None:
                raise SystemExit("this host's kernels keep Q4_K in the file's layout (no AVX2)")
            packed.append((repacked[1], cols, data.shape[0]))
        calls[variant] = partial(lambda kernels, packed, inputs: [
            kernels.linear(inputs[cols], "Q4_Kx8", data, None, rows) for data, cols, rows in packed], kernels, packed)
    for n in sizes:
        inputs = {cols: torch.randn(n, cols) for _, cols in matrices}
        reference = calls["file rows"](inputs)
        error = max(float((a - b).abs().max() / b.abs().max()) for variant in variants
                    for a, b in zip(calls[variant](inputs), reference))
        medians = interleaved_medians({t: partial(call, inputs) for t, call in calls.items()}, repeats=5, warmup=1)
        print(f"n={n}: " + ", ".join(f"{t} {s * 1e3:.0f} ms" for t, s in medians.items())
              + f" (largest relative difference {error:.1e})", flush=True)


def q5_0(marches: list[str]) -> None:
    """Every Q5_0 matrix of qwen2.5-coder-0.5b's layers against n activation rows, in the file's blocks and repacked
    as Q8_0 (decoder/kernels/cpu_kernels.cpp, repack), interleaved in time, on the host's build and on each -march
    named (haswell: the AVX2 paths); whether the two give bitwise the same products (rows=1,16: the n to time)."""
    from specplan.decoder.cpu_kernels import kernels as march_kernels

    marches, sizes = rows_option(marches, "1,2,3,4,5,8,12,16,17,32,64,256")
    matrices = k_quant_matrices("Q5_0", model="qwen2.5-coder-0.5b")
    for march in ["native", *marches]:
        kernels = march_kernels(march)
        layouts = {"Q5_0": [("Q5_0", data, cols) for data, cols in matrices],
                   "as Q8_0": [("Q8_0", kernels.repack("Q5_0", data, data.shape[0], cols)[1], cols)
                               for data, cols in matrices]}

        for n in sizes:
            inputs = {cols: torch.randn(n, cols) for _, cols in matrices}
            same = all(torch.equal(a, b) for a, b in zip(layout_products(kernels, layouts["Q5_0"], inputs),
                                                         layout_products(kernels, layouts["as Q8_0"], inputs)))
            medians = interleaved_medians({name: partial(layout_products, kernels, layout, inputs)
                                           for name, layout in layouts.items()}, repeats=7, warmup=1)
            print(f"-march={march} n={n}: Q5_0 {medians['Q5_0'] * 1e3:.2f} ms, as Q8_0 {medians['as Q8_0'] * 1e3:.2f} "
                  f"ms ({medians['Q5_0'] / medians['as Q8_0']:.2f}x); bitwise the same: {same}", flush=True)


def block_formats(marches: list[str]) -> None:
    """Passes of n activation rows over four random 8,960 x 1,536 matrices (gguf-py's quantizer) in each 32-value
    block format, interleaved, on the host's build and on each -march named (haswell: AVX2's native ymm paths);
    ms per pass (rows=1,4,8: the n to time)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from specplan.decoder.cpu_kernels import kernels as march_kernels

    marches, sizes = rows_option(marches, "1,4,8")
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((8960, 1536)).astype(np.float32) for _ in range(4)]
    layouts = {kind: [(kind, torch.from_numpy(np.ascontiguousarray(quantize(v, GGMLQuantizationType[kind]))
                                              .view(np.uint8).reshape(8960, -1)), 1536) for v in values]
               for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}
    for march in ["native", *marches]:
        kernels = march_kernels(march)
        for n in sizes:
            inputs = {1536: torch.randn(n, 1536)}
            medians = interleaved_medians({kind: partial(layout_products, kernels, layout, inputs)
                                           for kind, layout in layouts.items()}, repeats=5, warmup=1)
            print(f"-march={march} n={n}: " + ", ".join(f"{kind} {s * 1e3:.2f} ms" for kind, s in medians.items()),
                  flush=True)

def layout_products(kernels, layout: list[tuple[str, torch.Tensor, int]], inputs: dict) -> list[torch.Tensor]:
    """inputs' rows of each matrix's width times every (format, GGUF blocks [rows, bytes], columns) matrix."""
    return [kernels.linear(inputs[cols], kind, data, None, data.shape[0]) for kind, data, cols in layout]

ATTENTION_SHAPES = ((9, 3, 1), (9, 3, 2), (9, 3, 3), (12, 2, 1), (12, 2, 2))  # (heads, KV heads, new tokens)
ATTENTION_LAYER_SHAPES = ((9, 3, 1, 1), (9, 3, 2, 1), (9, 3, 3, 1), (9, 3, 2, 4), (12, 2, 1, 1), (14, 2, 1, 4))  # .., B


def attention(variants: list[str]) -> None:
    """One layer's attention of n new tokens over 300, 4096 and 7680 cached keys (fp32 cache, head size 64), the
    variants (NAME=VALUE,...) interleaved."""
    built = {v: build(dict(item.split("=") for item in v.split(","))) for v in variants}
    for heads, kv_heads, n in ATTENTION_SHAPES:
        for length in (300, 4096, 7680):
            q = torch.randn(heads * n, 64)
            keys, values = torch.randn(kv_heads, 8192, 64), torch.randn(kv_heads, 8192, 64)
            mask = torch.zeros(n, length) if n > 1 else torch.empty(0)
            calls = {v: partial(kernels.attention, q, [keys], [values], [n], [length], [mask], 0.125, 0.0, False)
                     for v, kernels in built.items()}
            medians = interleaved_medians(calls, repeats=100)
            print(f"{heads}/{kv_heads} n={n} L={length}: " + ", ".join(f"{v} {s * 1e6:.0f} us" for v, s in
                                                                      medians.items()), flush=True)


def attention_layers(variants: list[str]) -> None:
    """Every layer's attention of B sequences of n new tokens, each over its own fp32 cache of L keys (head size
    64, 28 layers: the caches cold, as in a forward), the variants (NAME=VALUE,...) interleaved, ms."""
    built = {v: build(dict(item.split("=") for item in v.split(","))) for v in variants}
    for heads, kv_heads, n, batch in ATTENTION_LAYER_SHAPES:
        for length in (1024, 7680):
            layers = [[(torch.randn(kv_heads, length, 64), torch.randn(kv_heads, length, 64)) for _ in range(batch)]
                      for _ in range(28)]
            q = torch.randn(batch * n * heads, 64)
            mask = torch.zeros(n, length) if n > 1 else torch.empty(0)
            calls = {v: partial(run_all, [partial(kernels.attention, q, [c[0] for c in layer], [c[1] for c in layer],
                                                  [n] * batch, [length] * batch, [mask] * batch, 0.125, 0.0, False)
                                          for layer in layers]) for v, kernels in built.items()}
            medians = interleaved_medians(calls, repeats=9, warmup=1)
            print(f"{heads}/{kv_heads} n={n} B={batch} L={length}: " + ", ".join(
                f"{v} {s * 1e3:.2f} ms" for v, s in medians.items()), flush=True)


def run_all(calls: list) -> None:
    for call in calls:
        call()


def gemm(thresholds: list[str]) -> None:
    """Every layer's matmuls of smollm2-135m (fp32) for 3 to 512 rows, each variant of TORCH_GEMM_ROWS interleaved."""
    weights = layer_matrices()
    variants = {threshold: build({"TORCH_GEMM_ROWS": threshold}) for threshold in thresholds}
    for n in (3, 4, 6, 8, 12, 16, 32, 64, 512):
        inputs = {w.shape[1]: torch.randn(n, w.shape[1]) for w in weights}
        calls = {threshold: partial(one_pass, partial(kernel_matmul, run, "F32"), weights, inputs)
                 for threshold, run in variants.items()}
        medians = interleaved_medians(calls, repeats=5, warmup=1)
        print(f"n={n}: " + ", ".join(f"TORCH_GEMM_ROWS={t} {s * 1e3:.1f} ms" for t, s in medians.items()), flush=True)


def forward(variants: list[str]) -> None:
    """Whole smollm2-135m forwards of n new rows on each variant (NAME=VALUE,...), interleaved: the measure the
    direct-row, GEMM and SDPA limits are chosen by. Options among the variants: dtype=fp32|gguf|bf16 (the weights),
    rows=1,2,4 (the n to time; 1-16 by default), context=300 (the cached tokens)."""
    from specplan.decoder.api import load_decoder
    from specplan.decoder.model import causal_mask

    variants, rows = rows_option(variants, "1,2,3,4,6,8,12,16")
    options = dict(item.split("=") for item in variants if item.split("=")[0] in ("dtype", "context"))
    variants = [v for v in variants if v.split("=")[0] not in options]
    context = int(options.get("context", "300"))
    model = load_decoder(None, target="smollm2-135m", dtype=options.get("dtype", "fp32"), device="cpu").target_forward
    cache = model.cache_for(context + max(rows), "target")
    model.prefill(torch.randint(0, 1000, (context,)), cache, logits=False)
    built = {variant: build(dict(item.split("=") for item in variant.split(","))) for variant in variants}

    def run(kernels, n: int) -> None:
        model.kernels = kernels
        mask = causal_mask(context, n, model.dtype, "cpu") if n > 1 else None
        model.forward(torch.arange(n) + 5, context + torch.arange(n), cache, mask)

    with torch.inference_mode():
        for n in rows:
            medians = interleaved_medians({v: partial(run, kernels, n) for v, kernels in built.items()}, repeats=15)
            print(f"n={n}: " + ", ".join(f"{v} {s * 1e3:.1f} ms" for v, s in medians.items()), flush=True)


def prefill(variants: list[str]) -> None:
    """Whole prefills of n tokens into an empty cache (qwen2.5-coder-1.5b's Q4_K_M, no logits) on each variant
    (NAME=VALUE,...), interleaved, three rounds; rows=64,512 the n to time."""
    from specplan.decoder.api import load_forward

    variants, sizes = rows_option(variants, "64,512")
    model = load_forward(load_model("qwen2.5-coder-1.5b", "gguf"), "cpu")
    cache = model.new_cache(max(sizes))
    ids = torch.randint(100, 5000, (max(sizes),), generator=torch.Generator().manual_seed(0))
    built = {variant: build(dict(item.split("=") for item in variant.split(","))) for variant in variants}

    def run(kernels, n: int) -> None:
        model.kernels = kernels
        cache.length = 0
        model.prefill(ids[:n], cache, chunk=n, logits=False)

    with torch.inference_mode():
        for n in sizes:
            for _ in range(3):
                medians = interleaved_medians({v: partial(run, kernels, n) for v, kernels in built.items()},
                                              repeats=3, warmup=1)
                print(f"n={n}: " + ", ".join(f"{v} {n / s:.1f} tokens/s" for v, s in medians.items()), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    {"tiles": tiles, "prefetch": prefetch, "prefetch-f32": prefetch_f32, "attention": attention, "gemm": gemm,
     "forward": forward, "q8k-tile": q8k_tile, "q4k-x8": q4k_x8, "row-tile": row_tile,
     "attention-layers": attention_layers, "prefill": prefill, "q5-0": q5_0,
     "block-formats": block_formats}[sys.argv[1]](sys.argv[2:])
