"""The CPU kernels of decoder/kernels/cpu_kernels.cpp, compiled once per host (gcc -O3 -march=native) with torch's
extension builder and cached beside the converted models; `kernels()` returns the module, or None where no
compiler is at hand (the forward then runs PyTorch's own operators, and says why once).

Set SPECPLAN_KERNELS=0 to run without them (the reference forward, for comparisons). `kernels(march)` builds for
another instruction set than the host's (tests run the AVX2 and the portable paths on an AVX-512 host).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

from core.models import cache_dir

SOURCE = Path(__file__).parent / "kernels" / "cpu_kernels.cpp"
FLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp"]
# GGML's type ids of the weight formats `linear` runs (and what they are called in a GGUF file)
WEIGHT_FORMATS = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
                  "BF16": 30}


def enabled() -> bool:
    return os.environ.get("SPECPLAN_KERNELS", "1") != "0"


def _host_features() -> str:
    """The instruction sets the build is specialised for (a cache built on one host is not reused on another)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return " ".join(sorted(flag for flag in flags.split() if flag.startswith(("avx", "fma", "f16c", "amx"))))


@functools.cache
def kernels(march: str = "native") -> ModuleType | None:
    if not enabled():
        return None
    flags = FLAGS + [f"-march={march}"]
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(flags), torch.__version__, sys.version,
                                    _host_features()]).encode()).hexdigest()[:16]
    build = cache_dir() / "kernels" / key
    build.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load

    try:
        return load(name=f"specplan_cpu_{key}", sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(build), verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, no ninja, a failed build
        print(f"specplan: CPU kernels unavailable ({str(exc).splitlines()[0][:200]}); running PyTorch's operators",
              file=sys.stderr)
        return None
