"""The CPU kernels of decoder/kernels/ (two translation units, compiled in parallel), built once per host (gcc -O3
-march=native) with torch's extension builder and cached beside the converted models, from a copy of the sources in
the cache (so that another checkout of the same sources reuses the build); `kernels()` returns the module, or None
where they cannot be built (the forward then runs PyTorch's own operators, and says why once).

Set SPECPLAN_KERNELS=0 to run without them (PyTorch's operators: the forward a GPU runs, for comparisons).
`kernels(march)` builds for another instruction set than the host's (tests run the AVX2 and the portable paths on an
AVX-512 host).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from specplan.core import progress
from specplan.core.fileio import atomic_output
from specplan.core.models import cache_dir

SOURCE_DIR = Path(__file__).parent / "kernels"
SOURCES = ["cpu_kernels.cpp", "linear.cpp"]  # compiled; they include the headers beside them
FLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp"]


def enabled() -> bool:
    return os.environ.get("SPECPLAN_KERNELS", "1") != "0"


def compiler() -> str | None:
    """The C++ compiler torch's extension builder would call, if one is installed."""
    return shutil.which(os.environ.get("CXX", "c++"))


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
    texts = {path.name: path.read_text() for path in sorted(SOURCE_DIR.glob("*.[ch]*"))}
    key = hashlib.sha256("\n".join([*texts.values(), " ".join(flags), torch.__version__, sys.version,
                                    _host_features()]).encode()).hexdigest()[:16]
    build = cache_dir() / "kernels" / key
    build.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():  # the same key means the same text: a copy is written once, its time kept
        if not (build / name).exists():
            with atomic_output(build / name) as handle:
                handle.write(text)
    from torch.utils.cpp_extension import load

    if not any(build.glob("*.so")):
        progress.say(f"building the CPU kernels for this host (-march={march}; once, about a minute; cached in "
                     f"{build})")
    try:
        with _building(build):
            return load(name=f"specplan_cpu_{key}", sources=[str(build / name) for name in SOURCES],
                        extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, no ninja, a failed build
        print(f"specplan: CPU kernels unavailable ({str(exc).splitlines()[0][:200]}); running PyTorch's operators",
              file=sys.stderr)
        return None


@contextmanager
def _building(build: Path) -> Iterator[None]:
    """One process at a time in `build`, under a lock the OS drops when its holder dies. torch's extension builder
    keeps its own lock as a file (`lock`) that a build killed midway leaves behind, and every later build then waits
    for it forever; whoever holds this lock knows such a file is left over and removes it."""
    with open(build / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield
