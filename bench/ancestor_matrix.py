"""A tree's ancestor matrix, compiled (decoder/tree.py), against the Python loop it replaced, side by side.

    python bench/ancestor_matrix.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from decoder.tree import ancestor_matrix

CALLS = 500


def python_loop(parents: list[int]) -> torch.Tensor:
    """The implementation before commit 0b51749."""
    allowed = torch.eye(len(parents), dtype=torch.bool)
    for v in range(1, len(parents)):
        allowed[v] |= allowed[parents[v]]
    return allowed


def main() -> None:
    rng = np.random.default_rng(0)
    for n in (8, 32, 64):
        parents = [-1] + [int(rng.integers(0, v)) for v in range(1, n)]
        assert torch.equal(ancestor_matrix(parents), python_loop(parents))
        micros = []
        for build in (python_loop, ancestor_matrix):
            start = time.perf_counter()
            for _ in range(CALLS):
                build(parents)
            micros.append((time.perf_counter() - start) / CALLS * 1e6)
        print(f"n={n}: python loop {micros[0]:.0f} us, compiled {micros[1]:.1f} us")


if __name__ == "__main__":
    main()
