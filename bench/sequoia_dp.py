"""Backs planner/sequoia.py's DP loop order (the inner loop over r with s fixed, which LLVM vectorises): the whole
G(n, d) table, JIT excluded, against two baselines run side by side: a plain-Python implementation of the same
recurrence and a straightforward numba loop (the textbook loop order).

    taskset -c 0 .venv/bin/python bench/sequoia_dp.py
"""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np
from numba import njit
from timing import median_seconds

from specplan.core.machine import cpu_info
from specplan.planner.sequoia import SequoiaTables

NEG = -np.inf


def python_reference(p: list[float], max_size: int, max_levels: int) -> list[list[float]]:
    """T(m, l, b) exactly as written in the paper, in plain Python; returns M[l][m] = max_b T(m, l, b)."""
    width = min(len(p), max_size - 1)
    M = [[NEG] * (max_size + 1) for _ in range(max_levels + 1)]
    for l in range(1, max_levels + 1):
        T = [[NEG] * (width + 1) for _ in range(max_size + 1)]
        T[1][0] = 1.0
        M[l][1] = 1.0
        if l > 1:
            for m in range(2, max_size + 1):
                T[m][1] = 1.0 + p[0] * M[l - 1][m - 1] if M[l - 1][m - 1] > NEG else NEG
                for b in range(2, min(width, m - 1) + 1):
                    best = NEG
                    for y in range(b, m):
                        left, right = T[y][b - 1], M[l - 1][m - y]
                        if left == NEG or right == NEG:
                            continue
                        best = max(best, left + p[b - 1] * right)
                    T[m][b] = best
                M[l][m] = max(T[m])
    return M


@njit(cache=True)
def numba_textbook(p: np.ndarray, max_size: int, max_levels: int) -> np.ndarray:
    """The same recurrence as a straightforward numba loop: for each (l, m, b) a max over y."""
    width = min(p.shape[0], max_size - 1)
    M = np.full((max_levels + 1, max_size + 1), NEG)
    T = np.full((max_size + 1, width + 1), NEG)
    for l in range(1, max_levels + 1):
        T[:, :] = NEG
        T[1, 0] = 1.0
        M[l, 1] = 1.0
        if l == 1:
            continue
        for m in range(2, max_size + 1):
            if M[l - 1, m - 1] > NEG:
                T[m, 1] = 1.0 + p[0] * M[l - 1, m - 1]
            best_m = T[m, 1]
            for b in range(2, min(width, m - 1) + 1):
                best = NEG
                for y in range(b, m):
                    left = T[y, b - 1]
                    right = M[l - 1, m - y]
                    if left == NEG or right == NEG:
                        continue
                    cand = left + p[b - 1] * right
                    if cand > best:
                        best = cand
                T[m, b] = best
                if best > best_m:
                    best_m = best
            M[l, m] = best_m
    return M


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=32)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    p = rng.random(args.width) ** 2
    p = p / p.sum() * 0.9
    print(f"machine: {cpu_info()['cpu']}, numpy {np.__version__}; K = {args.width}, "
          f"D = {args.depth}; median of repeats, JIT excluded")
    SequoiaTables(p, 4, 2)
    numba_textbook(p, 4, 3)

    ours = SequoiaTables(p, 128, args.depth)
    reference = python_reference(list(p), 128, args.depth + 1)
    textbook = numba_textbook(p, 128, args.depth + 1)
    ref_G = np.array(reference)[1:, :].T
    assert np.allclose(ours.G[np.isfinite(ref_G)], ref_G[np.isfinite(ref_G)], rtol=0, atol=1e-12)
    assert np.allclose(textbook[1:, :].T, ref_G, rtol=0, atol=1e-12)

    t_python = median_seconds(lambda: python_reference(list(p), 128, args.depth + 1), repeats=1, warmup=0)
    t_textbook_128 = median_seconds(lambda: numba_textbook(p, 128, args.depth + 1), repeats=3, warmup=0)
    t_ours_128 = median_seconds(lambda: SequoiaTables(p, 128, args.depth), repeats=5, warmup=0)
    print(f"N = 128:  plain Python {t_python:8.3f} s | numba textbook {t_textbook_128 * 1e3:8.2f} ms | "
          f"specplan {t_ours_128 * 1e3:8.2f} ms | specplan vs Python {t_python / t_ours_128:,.0f}x")
    for size in (1024, 2048):
        t_textbook = median_seconds(partial(numba_textbook, p, size, args.depth + 1), repeats=1, warmup=0)
        t_ours = median_seconds(partial(SequoiaTables, p, size, args.depth), repeats=3, warmup=0)
        print(f"N = {size}: numba textbook {t_textbook:8.3f} s | specplan {t_ours:8.3f} s | "
              f"ratio {t_textbook / t_ours:5.1f}x")


if __name__ == "__main__":
    main()
