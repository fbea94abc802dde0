"""What machine a profile was measured on, and microbenchmarks of this CPU for the roofline model."""

from __future__ import annotations

import platform
import time

import torch

from specplan.core.machine import cpu_info


def fingerprint(device: torch.device, dtype: str, threads: int) -> dict:
    info = {"device": device.type, "torch": torch.__version__, "dtype": dtype, "threads": threads,
            "platform": platform.platform(), **cpu_info()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1),
                    compute_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    return info


def best_time(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `fn`, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu(dtype: torch.dtype, repeats: int = 5) -> dict:
    """Streaming read bandwidth, matmul throughput (at 1 and 64 rows, like decode and verify) and per-op cost."""
    big = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, well past the caches
    seconds = best_time(lambda: big.sum(), repeats)
    bandwidth = big.numel() * big.element_size() / seconds
    weight = torch.randn(4096, 4096).to(dtype)
    rows = {}
    for n in (1, 16, 64, 256):
        x = torch.randn(n, 4096).to(dtype)
        rows[n] = best_time(lambda x=x: torch.nn.functional.linear(x, weight), repeats)
    flops_256 = 2 * 256 * 4096 * 4096 / rows[256]
    small = torch.randn(1, 64)
    per_op = best_time(lambda: [small.add(small) for _ in range(1000)], repeats) / 1000
    return {"bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": flops_256, "op_seconds": per_op,
            "matmul_4096_seconds": rows}
