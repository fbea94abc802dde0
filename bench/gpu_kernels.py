"""On a GPU: where one forward's time goes (torch.profiler over the lean forward run eagerly, in the static layout
the graphs replay: the kernels' durations are the graph's, the launch gaps are not). Per matmul weight shape, its
calls, microseconds per call and the share of the datasheet bandwidth its kernel streamed the weight at; the time
in matmuls, in attention and in everything else; the kernels by name (which GEMV or GEMM cuBLAS picked, and any
split-K reduction beside it). The cost model's open question (docs/benchmark-log.md, "The leave-one-out per
context"): one-row fp32 forwards stream their weights at 0.79-0.85 of the datasheet, bf16 ones at 0.45-0.73, as
seen from t(1) once the other kernels are paid.

    python bench/gpu_kernels.py --config DIR_WITH_CONFIG_JSON --dtypes fp32,bf16 --context 256 --sizes 1,2
    python bench/gpu_kernels.py --config .gpu/smollm2-135m --device cpu   # a dry run on this CPU (bench/gpu_carry.sh)
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM

from specplan.decoder.model import LeanModel, causal_mask
from specplan.profiler import roofline
from specplan.profiler.latency import random_cache

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# aten::linear's inputs are (x [n, k], weight [m, k], bias); its time holds its mm/addmm kernel and the bias's
LINEAR = "aten::linear"
SDPA = "aten::scaled_dot_product_attention"  # one row, or many rows with a mask (its time holds its kernels)
GROUPED_ATTENTION_OPS = ("aten::bmm", "aten::_softmax")  # the grouped path's score and value matmuls, its softmax
WARMUPS = 3
KERNEL_NAME_CHARACTERS = 90  # enough to tell cuBLAS's kernels apart (tile, split-K) without template noise


def device_microseconds(event, device: str) -> float:
    """An aggregated profiler row's time on the device, children included (torch renamed cuda_ to device_)."""
    if device == "cpu":
        return event.cpu_time_total
    return getattr(event, "device_time_total", None) or event.cuda_time_total


def profiled_forward(model: LeanModel, context: int, n: int, device: str):
    """The profile of one forward of n tokens over `context` keys."""
    cache = random_cache(model, context, n)
    tokens = torch.randint(0, model.shape.vocab, (n,), device=device)
    positions = torch.arange(context, context + n, device=device)
    mask = causal_mask(context, n, model.dtype, device)

    def forward() -> None:
        model.forward(tokens, positions, cache, mask, slots=positions.clone())

    for _ in range(WARMUPS):
        forward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        forward()
        if device == "cuda":
            torch.cuda.synchronize()
    return prof


def kernel_table(prof, most: int = 15) -> None:
    """The device's kernels by name (first KERNEL_NAME_CHARACTERS): how many one forward launched, their time.
    Which GEMV or GEMM kernel the library picked per dtype, and whether a split-K reduction runs beside it."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name[:KERNEL_NAME_CHARACTERS]]
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    print(f"{sum(count for count, _ in kernels.values())} kernels launched\n")
    print("| kernel | launches | us |")
    print("|---|---|---|")
    for name, (count, microseconds) in sorted(kernels.items(), key=lambda item: -item[1][1])[:most]:
        print(f"| {name} | {count} | {microseconds:.0f} |")
    print()


def report(rows, device: str, element: int, bandwidth: float | None) -> None:
    by_weight: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    linear_us = sdpa_us = grouped_us = 0.0
    for row in rows:
        microseconds = device_microseconds(row, device)
        if row.key == LINEAR:
            linear_us += microseconds
            entry = by_weight[(tuple(row.input_shapes[0]), tuple(row.input_shapes[1]))]
            entry[0] += row.count
            entry[1] += microseconds
        elif row.key == SDPA:
            sdpa_us += microseconds
        elif row.key in GROUPED_ATTENTION_OPS:
            grouped_us += microseconds
    attention_us = sdpa_us or grouped_us  # a forward takes one path; SDPA's math path runs bmm and softmax inside
    total_us = sum(row.self_device_time_total if device == "cuda" else row.self_cpu_time_total for row in rows)
    print("| input | weight | calls | us per call | weight GB/s | share of datasheet |")
    print("|---|---|---|---|---|---|")
    for (rows_shape, weight), (calls, microseconds) in sorted(by_weight.items(), key=lambda item: -item[1][1]):
        per_call = microseconds / calls
        rate = element * weight[0] * weight[1] / (per_call * 1e-6) / 1e9 if per_call > 0 else 0.0
        share = f"{rate / bandwidth:.2f}" if bandwidth else "-"
        print(f"| {list(rows_shape)} | {list(weight)} | {calls} | {per_call:.1f} | {rate:.0f} | {share} |")
    print(f"\nkernel time {total_us / 1e3:.3f} ms: linear layers {linear_us / 1e3:.3f}, attention "
          f"{attention_us / 1e3:.3f}, the rest {(total_us - linear_us - attention_us) / 1e3:.3f}\n")


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="a directory holding the model's config.json")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.config)
    if args.device == "cuda":
        name = torch.cuda.get_device_name(0)
        gpu = roofline.catalogue_name(name)
        bandwidth = roofline.CATALOGUE[gpu].bandwidth_gb_s if gpu else None
    else:
        name, bandwidth = "this CPU (a dry run)", None
    print(f"{config.model_type} ({config.num_hidden_layers} layers, hidden {config.hidden_size}) on {name}, "
          f"torch {torch.__version__}; random weights; L = {args.context}")
    for dtype_name in args.dtypes.split(","):
        torch.manual_seed(0)
        with torch.device(args.device):
            hf = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype_name]).eval()
        model = LeanModel(hf, args.device)
        for n in (int(size) for size in args.sizes.split(",")):
            print(f"## {dtype_name}, n = {n}\n")
            prof = profiled_forward(model, args.context, n, args.device)
            report(prof.key_averages(group_by_input_shape=True), args.device, roofline.BYTES_PER_ELEMENT[dtype_name],
                   bandwidth)
            kernel_table(prof)
        del hf, model


if __name__ == "__main__":
    main()
