"""What this machine is: CPU model and the instruction-set flags that matter for inference kernels."""

from __future__ import annotations

import os
import platform

INTERESTING_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")


def cpu_info() -> dict:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "cpu_flags": [f for f in INTERESTING_CPU_FLAGS if f in flags],
            "logical_cores": os.cpu_count()}
