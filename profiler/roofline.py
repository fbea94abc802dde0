"""Modeled t(n) for a GPU that is not at hand (`plan profile --gpu NAME`), and a roofline for this CPU.

A GPU forward of n new tokens over L cached ones, in this decoder's execution (every operator one kernel, replayed
as a CUDA graph), costs the sum of these terms:

    t(n, L) = (operators(n, L) - matmuls) * floor(n)          small kernels, floor(n) = op_seconds + op_row_seconds n
            + sum over the matmuls (k x m) of gemm(n) = max(floor(1), k m b / BW) for one row (a GEMV), else
                      gemm_floor(n) + max(k m b / BW, 2 rows(n) k m / (P gemm_efficiency(n) occupancy))
            + kv_bytes(L + n) / BW + [n = 1, fp32] attention_flops / attention_flops_fp32     attention
            + [n > 1] (attention_flops / P
                       + layers (L + n) (key_seconds(path) + heads n attention_score_seconds(path)))
                                                                                        multi-row attention

- operators(n, L): the kernels one forward launches, counted from the decoder's own forward (a two-layer copy of
  the model's config, traced once on the CPU with the GPU's attention path: one row through SDPA, 2-64 rows as
  grouped matmuls, more as masked SDPA; decoder/model.py: cuda_grouped_attention), plus the kernels SDPA itself
  launches (SDPA_KERNELS). The execution mode scales it: `graphs` (the lean backend), `compiled` (torch.compile
  fuses the elementwise operators: COMPILED_KERNEL_FRACTION of them remain) and `eager` (no graphs: the host
  dispatches each operator in eager_op_seconds while the GPU runs the earlier ones, so t = max(that, the sum
  above)). Each kernel lasts at least floor(n): a 135M model on an H100 is bound by this (1,330 kernels, 3 ms).
  A step of B sequences (t(B, n)) in this decoder runs each sequence's cache writes and attention apart, so its
  kernels are counted from a batched forward (profiler/operators.py: OperatorCounts); an engine whose attention
  takes the batch in one call per layer (vLLM: `plan profile --engine vllm`) launches one sequence's.
- gemm_floor_seconds: a matmul of two rows or more runs a GEMM kernel instead of a GEMV, which costs about a fixed
  time more whatever its size (measured: t(2) - t(1) is about 8 us per fp32 matmul and 3.7 us per bf16 one, for
  smollm2-135m and qwen2.5-coder-1.5b alike); one parameter per bucket of rows and dtype class, as the library
  picks another kernel per bucket (a split-K GEMM launches a second, reducing kernel) and its fixed cost with it:
  fitted, the fp32 floor is 7.9 us at 2-4 rows and 1.1-5.4 us beyond, the bf16 one 1.0 us rising to 9.4 us.
- BW = the datasheet bandwidth * bandwidth_efficiency; P = the datasheet dense peak of the dtype (plain FP32 for
  fp32: TF32 is off). A GEMM of n rows computes rows(n): n padded to its bucket (ROW_BUCKETS: up to 4, 8, 16, 32,
  64, 128; n itself beyond), the tile of rows its kernel runs, at gemm_efficiency(n) of P, one parameter per bucket
  and dtype class: the library picks another kernel per bucket, and the H100 measured curves no smooth law follows
  (in fp32, five models' t(8) rise most of the way to t(16), and t(32) falls back below t(16)); on the tensor cores,
  whose measured curves rise smoothly, a bucket reaches at least every smaller bucket's efficiency. occupancy(n, m) =
  min(1, tiles / SMs), tiles = max(1, rows(n) / 32) * ceil(m / 128) * splits: a skinny GEMM of a small model fills
  few of the GPU's multiprocessors, unless the library splits its depth k over several (split-K): splits = max(1,
  k / gemm_split_depth). Fitted, the tensor cores' depth is about 1,700 (Qwen 1.5B's 8,960-deep down projection fills
  half the H100 at 32 rows, where its 12 column tiles alone would fill a tenth) and fp32's is deeper than any
  matmul measured (the fp32 curves follow the column tiles alone).
- attention: one row in fp32 runs SDPA's math path (attention_flops_fp32 per second); one row in bf16/fp16 runs a
  flash kernel, bound by the KV bytes; several rows compute at the GEMM rate P and pay per layer and cached key,
  by path (cuda_grouped_attention): grouped matmuls materialize the [heads * n, L] score matrix in fp32 and pass
  over it four times (cast, scale, mask, softmax), so they pay attention_score_seconds_grouped per element on top
  of attention_key_seconds_grouped (about 30 ns per layer and key in fp32 at n = 2 whatever the model, measured on
  the H100); SDPA with a mask (bf16 below 4,096 keys, any dtype beyond 64 rows) runs one fused kernel whose blocks
  each sweep every key, so it pays per key attention_key_seconds_masked + head_dim *
  attention_key_dim_seconds_masked, nearly flat in n and in the heads (measured in bf16 between 256 and 1,024
  keys: 13.6-15.4 ns per layer and key at head size 64, 18.7-24 ns at 128, for 2 to 128 rows alike), and a small
  attention_score_seconds_masked per element.
- The decoding engine's host work per step (drafter, mask, verification) is not the GPU's: a modeled profile
  carries the engine_overhead_seconds of the calibration profiles (measured on that GPU's host), else the
  catalogue's DEFAULT_ENGINE_OVERHEAD, so that modeled plans are charged for it. The draft step is modeled alike.

Each term's parameter is named in GpuParameters. The catalogue gives the datasheet figures (cited per GPU);
DEFAULT_PARAMETERS were fitted to the H100 profiles measured with this decoder (`python
bench/modeled_vs_measured.py --fit`); `plan profile --gpu NAME --calibrate MEASURED.yaml ...` refits them to
measured profiles of that GPU, pulled towards these values (profiler/calibration.py: CALIBRATION_PRIOR_WEIGHT), and
records the fit and its residuals in the profile.

For this CPU (`--gpu cpu`): t = overhead + max(bytes / bandwidth, flops / matmul rate), from microbenchmarks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from specplan.core.errors import UserError
from specplan.decoder.model import ModelShape, cuda_grouped_attention
from specplan.profiler.operators import OperatorCounts

BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
TILE_ROWS, TILE_COLUMNS = 32, 128  # a typical cuBLAS/CUTLASS tile for skinny GEMMs: sets how many SMs n rows fill
ROW_BUCKETS = (4, 8, 16, 32, 64, 128)  # gemm_efficiency's buckets of rows (the last one takes every larger n)
# Kernels SDPA launches beyond its one operator, per call: fp32 runs the math path, bf16/fp16 a flash kernel.
# From the H100 (bench/gpu_forward.py): smollm2-135m's forward launched 1,330 kernels in fp32 and 1,122 in bf16
# where the decoder dispatches 1,001 operators (30 layers, one SDPA call each).
SDPA_KERNELS = {"fp32": 11, "tensor": 4}
# torch.compile's share of the kernels (same runs: 588 of 1,330 in fp32, 410 of 1,122 in bf16)
COMPILED_KERNEL_FRACTION = {"fp32": 588 / 1330, "tensor": 410 / 1122}
EXECUTION_MODES = ("graphs", "compiled", "eager")
# the engine's host work per step on the H100's host (profiles/qwen2.5-coder-1.5b.h100.bf16.yaml), {n: seconds}
DEFAULT_ENGINE_OVERHEAD = {1: 0.09e-3, 2: 0.12e-3, 4: 0.14e-3, 8: 0.13e-3, 16: 0.15e-3, 32: 0.17e-3, 64: 0.22e-3,
                           128: 0.54e-3}


def dtype_class(dtype: str) -> str:
    """fp32 runs on the CUDA cores; bf16 and fp16 on the tensor cores."""
    return "fp32" if dtype == "fp32" else "tensor"


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gb: float
    bandwidth_gb_s: float
    tflops: dict  # dense (no sparsity) throughput per dtype; fp32 = plain FP32 (no TF32)
    sms: int  # streaming multiprocessors
    host_link: str  # its link to host memory (profiler/offload.py: HOST_LINKS), from the same datasheet
    device_names: str  # a regular expression that torch's name of this device, in lower case, matches
    source: str


# Exactly one pattern matches each device name (a name no pattern matches is not in the catalogue): the variants of
# one GPU differ in bandwidth by up to 1.7x (H100 SXM5 3.35 TB/s, PCIe 2.0 TB/s).
CATALOGUE: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("a100-40g", 40, 1555, {"fp32": 19.5, "bf16": 312, "fp16": 312}, 108, "pcie4-x16", r"\ba100\b.*\b40gb\b",
                "NVIDIA A100 Tensor Core GPU datasheet (2021), 40GB (SXM4 and PCIe): HBM2 1,555 GB/s; A100 "
                "whitepaper: 108 SMs"),
    Accelerator("a100-80g", 80, 2039, {"fp32": 19.5, "bf16": 312, "fp16": 312}, 108, "pcie4-x16",
                r"^(?!.*\bpcie\b).*\ba100\b.*\b80gb\b",
                "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 80GB: HBM2e 2,039 GB/s; 108 SMs"),
    Accelerator("a100-80g-pcie", 80, 1935, {"fp32": 19.5, "bf16": 312, "fp16": 312}, 108, "pcie4-x16",
                r"^(?=.*\bpcie\b).*\ba100\b.*\b80gb\b",
                "NVIDIA A100 Tensor Core GPU datasheet (2021), PCIe 80GB: HBM2e 1,935 GB/s; 108 SMs"),
    Accelerator("a10", 24, 600, {"fp32": 31.2, "bf16": 125, "fp16": 125}, 72, "pcie4-x16", r"\ba10g?\b",
                "NVIDIA A10 Tensor Core GPU datasheet (2021): GDDR6 600 GB/s, 125 TFLOPS BF16 dense; 72 SMs (AWS's "
                "A10G, without an NVIDIA datasheet, has its 600 GB/s and is taken for it)"),
    Accelerator("v100", 32, 900, {"fp32": 15.7, "fp16": 125}, 80, "pcie3-x16", r"\bv100\b",
                "NVIDIA V100 Tensor Core GPU datasheet (2020), SXM2 32GB: HBM2 900 GB/s; no BF16; 80 SMs"),
    Accelerator("t4", 16, 320, {"fp32": 8.1, "fp16": 65}, 40, "pcie3-x16", r"\bt4\b",
                "NVIDIA T4 datasheet (2019): GDDR6 320 GB/s, 65 TFLOPS FP16 mixed precision; no BF16; 40 SMs"),
    Accelerator("l4", 24, 300, {"fp32": 30.3, "bf16": 121, "fp16": 121}, 58, "pcie4-x16", r"\bl4\b",
                "NVIDIA L4 Tensor Core GPU datasheet (2023): GDDR6 300 GB/s, 30.3 TFLOPS FP32, 242 TFLOPS FP16/BF16 "
                "with sparsity (121 dense); 7,424 CUDA cores, 58 SMs"),
    Accelerator("l40", 48, 864, {"fp32": 90.5, "bf16": 181, "fp16": 181}, 142, "pcie4-x16", r"\bl40\b",
                "NVIDIA L40 datasheet (2022): GDDR6 864 GB/s, 181 TFLOPS FP16/BF16 dense; 142 SMs"),
    Accelerator("l40s", 48, 864, {"fp32": 91.6, "bf16": 366, "fp16": 366}, 142, "pcie4-x16", r"\bl40s\b",
                "NVIDIA L40S datasheet (2023): GDDR6 864 GB/s, 366 TFLOPS FP16/BF16 dense; 142 SMs"),
    Accelerator("a6000", 48, 768, {"fp32": 38.7, "bf16": 154.8, "fp16": 154.8}, 84, "pcie4-x16", r"\brtx a6000\b",
                "NVIDIA RTX A6000 datasheet (2021): GDDR6 768 GB/s, 38.7 TFLOPS FP32, 309.7 TFLOPS tensor with "
                "sparsity (154.8 dense); 10,752 CUDA cores, 84 SMs"),
    Accelerator("rtx3090", 24, 936, {"fp32": 35.6, "bf16": 71, "fp16": 71}, 82, "pcie4-x16", r"\brtx 3090\b(?! ti)",
                "NVIDIA Ampere GA102 GPU architecture whitepaper (2021), RTX 3090: GDDR6X 936 GB/s, 35.6 TFLOPS FP32, "
                "71 TFLOPS FP16/BF16 tensor with FP32 accumulate (dense); 82 SMs"),
    Accelerator("rtx4090", 24, 1008, {"fp32": 82.6, "bf16": 165, "fp16": 165}, 128, "pcie4-x16", r"\brtx 4090\b",
                "NVIDIA Ada GPU architecture whitepaper (2022), RTX 4090: 1,008 GB/s, 165 TFLOPS FP16 (FP32 acc.), "
                "128 SMs"),
    Accelerator("h100", 80, 3350, {"fp32": 67, "bf16": 989, "fp16": 989}, 132, "pcie5-x16",
                r"^(?!.*\b(pcie|nvl)\b).*\bh100\b",
                "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5 80GB: HBM3 3.35 TB/s, 989 TFLOPS BF16 dense; "
                "132 SMs"),
    Accelerator("h100-pcie", 80, 2000, {"fp32": 51, "bf16": 756, "fp16": 756}, 114, "pcie5-x16", r"\bh100\b.*\bpcie\b",
                "NVIDIA H100 Tensor Core GPU datasheet (2023), PCIe 80GB: HBM2e 2 TB/s, 51 TFLOPS FP32, 1,513 TFLOPS "
                "BF16 with sparsity (756 dense); 114 SMs"),
    Accelerator("h100-nvl", 94, 3900, {"fp32": 60, "bf16": 835, "fp16": 835}, 132, "pcie5-x16", r"\bh100\b.*\bnvl\b",
                "NVIDIA H100 Tensor Core GPU datasheet (2024), H100 NVL 94GB: HBM3 3.9 TB/s, 60 TFLOPS FP32, 1,671 "
                "TFLOPS BF16 with sparsity (835 dense); 132 SMs"),
    Accelerator("h200", 141, 4800, {"fp32": 67, "bf16": 989, "fp16": 989}, 132, "pcie5-x16", r"\bh200\b",
                "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM 141GB: HBM3e 4.8 TB/s, 989 TFLOPS BF16 dense; "
                "132 SMs"),
)}


@dataclass(frozen=True)
class GpuParameters:
    """The cost model's parameters for one GPU (the module docstring says where each enters)."""

    op_seconds: float  # one kernel replayed in a CUDA graph: launch gap plus a small kernel's minimum duration
    op_row_seconds: float  # added to each kernel per new-token row
    eager_op_seconds: float  # one operator dispatched eagerly (no graph): host-bound
    bandwidth_efficiency: float  # share of the datasheet bandwidth that weight and KV streams reach
    # share of the FP32 peak an fp32 GEMM of up to 4 (5-8, ..., 65 or more) rows reaches, fully occupied
    gemm_efficiency_fp32_rows4: float
    gemm_efficiency_fp32_rows8: float
    gemm_efficiency_fp32_rows16: float
    gemm_efficiency_fp32_rows32: float
    gemm_efficiency_fp32_rows64: float
    gemm_efficiency_fp32_rows128: float
    # the same on the tensor cores (bf16, fp16)
    gemm_efficiency_tensor_rows4: float
    gemm_efficiency_tensor_rows8: float
    gemm_efficiency_tensor_rows16: float
    gemm_efficiency_tensor_rows32: float
    gemm_efficiency_tensor_rows64: float
    gemm_efficiency_tensor_rows128: float
    # a GEMM of depth k (its weight's input size) runs k / gemm_split_depth slices in parallel (split-K), at least one
    gemm_split_depth_fp32: float
    gemm_split_depth_tensor: float
    # what a matmul of 2-4 (5-8, ..., 65 or more) rows (a GEMM, not a GEMV) costs beyond its work, fp32
    gemm_floor_seconds_fp32_rows4: float
    gemm_floor_seconds_fp32_rows8: float
    gemm_floor_seconds_fp32_rows16: float
    gemm_floor_seconds_fp32_rows32: float
    gemm_floor_seconds_fp32_rows64: float
    gemm_floor_seconds_fp32_rows128: float
    # the same in bf16/fp16
    gemm_floor_seconds_tensor_rows4: float
    gemm_floor_seconds_tensor_rows8: float
    gemm_floor_seconds_tensor_rows16: float
    gemm_floor_seconds_tensor_rows32: float
    gemm_floor_seconds_tensor_rows64: float
    gemm_floor_seconds_tensor_rows128: float
    attention_flops_fp32: float  # FLOP/s of one-row fp32 SDPA (its math path)
    attention_key_seconds_grouped_fp32: float  # 2-64 rows as grouped matmuls with a mask, per layer and key, fp32
    attention_key_seconds_grouped_tensor: float  # the same in bf16/fp16
    attention_key_seconds_masked_fp32: float  # rows through SDPA with a mask, per layer and key, fp32
    attention_key_seconds_masked_tensor: float  # the same in bf16/fp16
    attention_key_dim_seconds_masked_fp32: float  # added per cached key and head dimension, per layer, fp32
    attention_key_dim_seconds_masked_tensor: float  # the same in bf16/fp16
    attention_score_seconds_grouped_fp32: float  # grouped matmuls, per layer, query head, row and key, fp32
    attention_score_seconds_grouped_tensor: float  # the same in bf16/fp16
    attention_score_seconds_masked_fp32: float  # SDPA with a mask, per layer, query head, row and key, fp32
    attention_score_seconds_masked_tensor: float  # the same in bf16/fp16

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def gemm_efficiency(self, kind: str, n: int) -> float:
        """The bucket's efficiency; on the tensor cores at least that of every smaller bucket (their measured
        curves rise smoothly with n, and a bigger tile's kernel is free to run a smaller one's in pieces)."""
        if kind == "fp32":
            return getattr(self, f"gemm_efficiency_fp32_rows{row_bucket(n)}")
        return max(getattr(self, f"gemm_efficiency_tensor_rows{rows}") for rows in ROW_BUCKETS if rows <= row_bucket(n))

    def gemm_floor(self, kind: str, n: int) -> float:
        return getattr(self, f"gemm_floor_seconds_{kind}_rows{row_bucket(n)}")


def row_bucket(n: int) -> int:
    return next((rows for rows in ROW_BUCKETS if n <= rows), ROW_BUCKETS[-1])


def gemm_rows(n: int) -> int:
    """The rows a GEMM of n computes: its bucket's (the kernel's tile of rows), n itself beyond the last bucket."""
    return max(n, row_bucket(n))


PARAMETER_NAMES = tuple(f.name for f in fields(GpuParameters))
# Fitted to the H100 profiles measured with this decoder (bench/modeled_vs_measured.py --fit; the fit's errors are
# in docs/benchmark-log.md): the
# per-kernel cost and the attention terms are properties of the kernels and of a GPU of this generation; the
# datasheet figures scale the rest to other GPUs. eager_op_seconds is PyTorch's eager dispatch cost per operator,
# about 8 us on a server CPU (not measured here).
DEFAULT_PARAMETERS = GpuParameters(
    op_seconds=2.26e-06, op_row_seconds=1e-12, eager_op_seconds=8e-06, bandwidth_efficiency=0.76,
    gemm_efficiency_fp32_rows4=1, gemm_efficiency_fp32_rows8=0.331, gemm_efficiency_fp32_rows16=0.596,
    gemm_efficiency_fp32_rows32=1, gemm_efficiency_fp32_rows64=1, gemm_efficiency_fp32_rows128=0.867,
    gemm_efficiency_tensor_rows4=0.0252, gemm_efficiency_tensor_rows8=0.053, gemm_efficiency_tensor_rows16=0.103,
    gemm_efficiency_tensor_rows32=0.201, gemm_efficiency_tensor_rows64=0.549, gemm_efficiency_tensor_rows128=1,
    gemm_split_depth_fp32=2.37e+04, gemm_split_depth_tensor=1.72e+03, gemm_floor_seconds_fp32_rows4=7.87e-06,
    gemm_floor_seconds_fp32_rows8=1.36e-06, gemm_floor_seconds_fp32_rows16=4.47e-06,
    gemm_floor_seconds_fp32_rows32=1.09e-06, gemm_floor_seconds_fp32_rows64=5.41e-06,
    gemm_floor_seconds_fp32_rows128=1.75e-06, gemm_floor_seconds_tensor_rows4=1.03e-06,
    gemm_floor_seconds_tensor_rows8=2.18e-06, gemm_floor_seconds_tensor_rows16=3.27e-06,
    gemm_floor_seconds_tensor_rows32=3.6e-06, gemm_floor_seconds_tensor_rows64=7.32e-06,
    gemm_floor_seconds_tensor_rows128=9.4e-06, attention_flops_fp32=3.87e+11,
    attention_key_seconds_grouped_fp32=3e-08, attention_key_seconds_grouped_tensor=3.55e-09,
    attention_key_seconds_masked_fp32=3.28e-08, attention_key_seconds_masked_tensor=1e-12,
    attention_key_dim_seconds_masked_fp32=9.59e-11, attention_key_dim_seconds_masked_tensor=1.67e-10,
    attention_score_seconds_grouped_fp32=9.72e-12, attention_score_seconds_grouped_tensor=1.36e-11,
    attention_score_seconds_masked_fp32=1.57e-11, attention_score_seconds_masked_tensor=1e-12)


@dataclass(frozen=True)
class GpuModelCost:
    """What a forward of one model costs, independent of the GPU: its matmuls, KV cache and kernel counts."""

    layers: int
    gemms: tuple[tuple[int, int, int], ...]  # (count per forward, k, m): each matmul's weight shape
    kv_bytes_per_token: int
    attention_width: int  # layers * heads * head_dim
    heads: int  # query heads per layer
    head_dim: int
    dtype: str
    operators: OperatorCounts  # kernels per forward by attention path (single, grouped, masked), alone and batched
    # whether each further sequence of a batched step launches its own cache writes and attention (this decoder), or
    # the batch's attention is one call per layer (vLLM)
    sequence_kernels: bool = True

    def attention_path(self, n: int, context: int) -> str:
        if n == 1:
            return "single"
        return "grouped" if cuda_grouped_attention(n, context + n, self.dtype == "fp32") else "masked"

    def kernels(self, n: int, context: int, mode: str, batch: int = 1) -> float:
        """Kernels of a step of `batch` sequences (see `sequence_kernels`)."""
        path = self.attention_path(n, context)
        sdpa = self.layers * SDPA_KERNELS[dtype_class(self.dtype)] if path != "grouped" else 0
        launching = batch if self.sequence_kernels else 1
        count = self.operators.batched(path, launching) + launching * sdpa
        return count * COMPILED_KERNEL_FRACTION[dtype_class(self.dtype)] if mode == "compiled" else count


def gpu_model_cost(shape: ModelShape, intermediate: int, dtype: str, operators: OperatorCounts,
                   output_rows: int | None = None) -> GpuModelCost:
    """`output_rows`: rows of the output matrix a forward reads (a draft with a limited vocabulary)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    layers = shape.layers
    gemms = ((layers, shape.hidden, q + 2 * kv), (layers, q, shape.hidden), (layers, shape.hidden, 2 * intermediate),
             (layers, intermediate, shape.hidden), (1, shape.hidden, output_rows or shape.vocab))
    return GpuModelCost(layers, gemms, 2 * layers * kv * BYTES_PER_ELEMENT[dtype], layers * q, shape.heads,
                        shape.head_dim, dtype, operators)


def gpu_forward_seconds(cost: GpuModelCost, gpu: Accelerator, p: GpuParameters, n: int, context: int,
                        mode: str = "graphs", batch: int = 1) -> float:
    """t(n) at `context` cached tokens (the module docstring's formula); with `batch` > 1, t(B, n): a step of B
    sequences of n new tokens each, every sequence over its own `context` cached tokens. The weights are read once
    for the step, the GEMMs compute B x n rows, and attention reads and scores each sequence's own keys."""
    if cost.dtype not in gpu.tflops:
        raise UserError(f"{gpu.name} has no {cost.dtype} support")
    kind = dtype_class(cost.dtype)
    bandwidth = gpu.bandwidth_gb_s * 1e9 * p.bandwidth_efficiency
    peak = gpu.tflops[cost.dtype] * 1e12 * p.gemm_efficiency(kind, batch * n)
    kernels = cost.kernels(n, context, mode, batch)
    gemm_kernels = sum(count for count, _, _ in cost.gemms)
    rows_in_step = batch * n
    kernel_floor = p.op_seconds + p.op_row_seconds * rows_in_step
    seconds = (kernels - gemm_kernels) * kernel_floor
    element = BYTES_PER_ELEMENT[cost.dtype]
    rows = gemm_rows(rows_in_step)
    row_tiles = max(1.0, rows / TILE_ROWS)
    gemm_floor = p.gemm_floor(kind, rows_in_step)
    for count, k, m in cost.gemms:
        splits = max(1.0, k / getattr(p, f"gemm_split_depth_{kind}"))
        occupancy = min(1.0, row_tiles * math.ceil(m / TILE_COLUMNS) * splits / gpu.sms)
        stream = k * m * element / bandwidth
        if rows_in_step == 1:  # a GEMV: 2 FLOPs per weight read, never compute-bound
            seconds += count * max(kernel_floor, stream)
        else:
            seconds += count * (gemm_floor + max(stream, 2.0 * rows * k * m / (peak * occupancy)))
    attention_flops = 4.0 * cost.attention_width * n * (context + n) * batch
    seconds += cost.kv_bytes_per_token * (context + n) * batch / bandwidth
    if n == 1:  # fp32 SDPA runs its math path; bf16/fp16 a flash kernel, bound by the KV bytes
        seconds += attention_flops / p.attention_flops_fp32 if kind == "fp32" else 0.0
    else:
        seconds += attention_flops / peak
        path = cost.attention_path(n, context)
        key_seconds = getattr(p, f"attention_key_seconds_{path}_{kind}")
        if path == "masked":
            key_seconds += cost.head_dim * getattr(p, f"attention_key_dim_seconds_masked_{kind}")
        score_seconds = getattr(p, f"attention_score_seconds_{path}_{kind}")
        seconds += cost.layers * (context + n) * batch * (key_seconds + cost.heads * n * score_seconds)
    # Eagerly, the host enqueues each kernel while the GPU runs the earlier ones: the slower of the two sets the pace.
    return max(seconds, kernels * p.eager_op_seconds) if mode == "eager" else seconds


# --- the CPU roofline (--gpu cpu) ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelCost:
    matmul_params: int
    kv_bytes_per_token: int
    attention_width: int  # layers * heads * head_dim
    bytes_per_element: int

    @classmethod
    def from_shape(cls, shape: ModelShape, intermediate: int, dtype: str, output_rows: int | None = None
                   ) -> ModelCost:
        """`output_rows`: rows of the output matrix that a forward reads (a draft with a limited vocabulary)."""
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        per_layer = shape.hidden * (q + 2 * kv) + q * shape.hidden + 3 * shape.hidden * intermediate
        element = BYTES_PER_ELEMENT[dtype]
        return cls(
            matmul_params=shape.layers * per_layer + (output_rows or shape.vocab) * shape.hidden,
            kv_bytes_per_token=2 * shape.layers * kv * element,
            attention_width=shape.layers * q,
            bytes_per_element=element,
        )

    def bytes_moved(self, n: int, context: int) -> float:
        return self.matmul_params * self.bytes_per_element + self.kv_bytes_per_token * (context + n)

    def flops(self, n: int, context: int) -> float:
        return 2.0 * self.matmul_params * n + 4.0 * self.attention_width * n * (context + n)

    def resident_bytes(self, total_params: int, max_tokens: int) -> float:
        return total_params * self.bytes_per_element + self.kv_bytes_per_token * max_tokens


def roofline_seconds(cost: ModelCost, n: int, context: int, bandwidth: float, flops_per_s: float,
                     overhead: float) -> float:
    return overhead + max(cost.bytes_moved(n, context) / bandwidth, cost.flops(n, context) / flops_per_s)


def catalogue_name(device_name: str) -> str | None:
    """The catalogue GPU a device name (torch's, or a profile's hardware.gpu) is, if any."""
    matches = [gpu.name for gpu in CATALOGUE.values() if re.search(gpu.device_names, device_name.lower())]
    return matches[0] if len(matches) == 1 else None


# A GPU's bare name where the catalogue holds several variants of it: the SXM one with the most memory, as `h100` is
# the SXM5 (a profile names the variant it modeled: hardware.gpu)
BARE_NAMES = {"a100": "a100-80g"}


def accelerator(name: str) -> Accelerator:
    """A catalogue GPU by its name there (or its bare name: BARE_NAMES), or by the device's own name (what
    nvidia-smi and torch print)."""
    lowered = BARE_NAMES.get(name.lower(), name.lower())
    key = lowered if lowered in CATALOGUE else catalogue_name(name)
    if key is None:
        raise UserError(f"unknown GPU {name!r} (known: {', '.join(CATALOGUE)}, or cpu)")
    return CATALOGUE[key]
