"""Roofline-modeled t(n) for accelerators not at hand (and for this CPU, from microbenchmarks).

For a forward of n new tokens over a context of L cached tokens:

    t(n, L) = overhead + max(bytes(L, n) / (bandwidth * BANDWIDTH_EFFICIENCY),
                             flops(n, L) / (peak_flops * COMPUTE_EFFICIENCY))
    bytes(L, n) = weight bytes of every matmul (lm_head included) + KV cache bytes for L + n tokens
    flops(n, L) = 2 * matmul parameters * n + 4 * layers * heads * head_dim * n * (L + n)   (QK^T and PV)

The per-forward overhead stands for kernel launches under CUDA graphs, sampling and host work.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import UserError
from decoder.model import ModelShape

# Fractions of the datasheet peaks that tuned inference kernels reach (assumptions, not measurements).
BANDWIDTH_EFFICIENCY = 0.80
COMPUTE_EFFICIENCY = 0.60
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gb: float
    bandwidth_gb_s: float
    tflops: dict  # dense (no sparsity) throughput per dtype; fp32 = plain FP32 (no TF32)
    overhead_s: float
    source: str


# Datasheet numbers; the overhead is a CUDA-graph replay plus sampling (order 100 us on recent GPUs).
CATALOGUE: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("a100-40g", 40, 1555, {"fp32": 19.5, "bf16": 312, "fp16": 312}, 100e-6,
                "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 40GB: HBM2 1,555 GB/s"),
    Accelerator("a100-80g", 80, 2039, {"fp32": 19.5, "bf16": 312, "fp16": 312}, 100e-6,
                "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM4 80GB: HBM2e 2,039 GB/s"),
    Accelerator("a10", 24, 600, {"fp32": 31.2, "bf16": 125, "fp16": 125}, 120e-6,
                "NVIDIA A10 Tensor Core GPU datasheet (2021): GDDR6 600 GB/s, 125 TFLOPS BF16 dense"),
    Accelerator("v100", 32, 900, {"fp32": 15.7, "fp16": 125}, 150e-6,
                "NVIDIA V100 Tensor Core GPU datasheet (2020), SXM2 32GB: HBM2 900 GB/s; no BF16"),
    Accelerator("l40", 48, 864, {"fp32": 90.5, "bf16": 181, "fp16": 181}, 110e-6,
                "NVIDIA L40 datasheet (2022): GDDR6 864 GB/s, 181 TFLOPS FP16/BF16 dense"),
    Accelerator("l40s", 48, 864, {"fp32": 91.6, "bf16": 366, "fp16": 366}, 110e-6,
                "NVIDIA L40S datasheet (2023): GDDR6 864 GB/s, 366 TFLOPS FP16/BF16 dense"),
    Accelerator("rtx4090", 24, 1008, {"fp32": 82.6, "bf16": 165, "fp16": 165}, 100e-6,
                "NVIDIA Ada GPU architecture whitepaper (2022), RTX 4090: 1,008 GB/s, 165 TFLOPS FP16 (FP32 acc.)"),
    Accelerator("h100", 80, 3350, {"fp32": 67, "bf16": 989, "fp16": 989}, 80e-6,
                "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5 80GB: HBM3 3.35 TB/s, 989 TFLOPS BF16 dense"),
    Accelerator("h200", 141, 4800, {"fp32": 67, "bf16": 989, "fp16": 989}, 80e-6,
                "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM 141GB: HBM3e 4.8 TB/s, 989 TFLOPS BF16 dense"),
)}


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


def accelerator(name: str) -> Accelerator:
    if name not in CATALOGUE:
        raise UserError(f"unknown GPU {name!r} (known: {', '.join(CATALOGUE)}, or cpu)")
    return CATALOGUE[name]


def gpu_rates(gpu: Accelerator, dtype: str) -> tuple[float, float]:
    """(effective bandwidth bytes/s, effective FLOP/s) for `dtype` on `gpu`."""
    if dtype not in gpu.tflops:
        raise UserError(f"{gpu.name} has no {dtype} support")
    return gpu.bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY, gpu.tflops[dtype] * 1e12 * COMPUTE_EFFICIENCY


def check_fits(gpu: Accelerator, model_name: str, cost: ModelCost, total_params: int, max_tokens: int) -> None:
    needed = cost.resident_bytes(total_params, max_tokens)
    if needed > gpu.memory_gb * 1e9:
        raise UserError(f"{model_name} needs {needed / 1e9:.1f} GB (weights + KV cache for {max_tokens} tokens) "
                        f"but {gpu.name} has {gpu.memory_gb:g} GB")
