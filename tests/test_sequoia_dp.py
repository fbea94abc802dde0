"""Exactness of the Sequoia tree DP against brute force, its reconstruction, and a Monte-Carlo check."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from specplan.planner.sequoia import SequoiaTables, depth_unbounded_values, tree_value


@functools.cache
def ordered_trees(n: int) -> tuple[tuple, ...]:
    """All ordered rooted trees with n nodes, as nested tuples of child subtrees."""
    if n == 1:
        return ((),)
    out = []

    def forests(total: int) -> list[tuple]:
        if total == 0:
            return [()]
        result = []
        for first in range(1, total + 1):
            for head in ordered_trees(first):
                for rest in forests(total - first):
                    result.append((head,) + rest)
        return result

    out.extend(forests(n - 1))
    return tuple(out)


def value(tree: tuple, p: np.ndarray) -> float:
    return 1.0 + sum(p[k] * value(child, p) for k, child in enumerate(tree))


def depth(tree: tuple) -> int:
    return 0 if not tree else 1 + max(depth(c) for c in tree)


def max_width(tree: tuple) -> int:
    return max([len(tree)] + [max_width(c) for c in tree])


def brute_force_table(p: np.ndarray, max_size: int, max_depth: int) -> np.ndarray:
    G = np.full((max_size + 1, max_depth + 1), -np.inf)
    for n in range(1, max_size + 1):
        for tree in ordered_trees(n):
            if max_width(tree) > len(p):
                continue
            v, d = value(tree, p), depth(tree)
            for dd in range(d, max_depth + 1):
                G[n, dd] = max(G[n, dd], v)
    return G


def random_vector(rng: np.random.Generator, width: int, zeros: int) -> np.ndarray:
    p = rng.random(width) ** 2  # non-monotone by construction
    p[rng.choice(width, size=min(zeros, width), replace=False)] = 0.0
    return p / max(p.sum(), 1e-12) * rng.uniform(0.3, 1.0)


def test_brute_force_counts_all_ordered_trees():
    assert [len(ordered_trees(n)) for n in range(1, 10)] == [1, 1, 2, 5, 14, 42, 132, 429, 1430]


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force_up_to_nine_nodes(seed):
    rng = np.random.default_rng(seed)
    width = int(rng.integers(1, 9))
    p = random_vector(rng, width, zeros=int(rng.integers(0, 3)))
    dp = SequoiaTables(p, 9, 8).G
    brute = brute_force_table(p, 9, 8)
    assert np.array_equal(np.isfinite(dp), np.isfinite(brute))
    finite = np.isfinite(brute)
    np.testing.assert_allclose(dp[finite], brute[finite], rtol=0, atol=1e-12)


def test_zero_entries_produce_no_nan():
    p = np.array([0.0, 0.5, 0.0, 0.3])
    G = SequoiaTables(p, 40, 6).G
    assert not np.isnan(G).any()
    assert G[1, 0] == 1.0 and G[1, 6] == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_reconstructed_tree_attains_G(seed):
    rng = np.random.default_rng(100 + seed)
    p = random_vector(rng, 64 if seed == 0 else int(rng.integers(2, 33)), zeros=int(rng.integers(0, 6)))
    tables = SequoiaTables(p, 96, 10)
    G = tables.G
    for n in range(1, 97, 5):
        for d in range(0, 11):
            if not np.isfinite(G[n, d]):
                continue
            parents = tables.tree(n, d)
            assert len(parents) == n
            assert parents[0] == -1 and all(0 <= parents[v] < v for v in range(1, n))
            assert list(parents[1:]) == sorted(parents[1:]), "BFS order with contiguous siblings"
            depths = np.zeros(n, dtype=int)
            for v in range(1, n):
                depths[v] = depths[parents[v]] + 1
            assert depths.max() <= d
            assert tree_value(parents, p) == pytest.approx(G[n, d], rel=0, abs=1e-12)


def test_reconstruction_is_deterministic_under_ties():
    p = np.array([0.4, 0.0, 0.0, 0.2, 0.0])  # zeros create many equal-valued trees
    first = SequoiaTables(p, 30, 5).tree(30, 5)
    second = SequoiaTables(p, 30, 5).tree(30, 5)
    assert np.array_equal(first, second)


def test_depth_unbounded_equals_deepest_table():
    rng = np.random.default_rng(7)
    p = random_vector(rng, 16, zeros=3)
    c = depth_unbounded_values(p, 60)
    G = SequoiaTables(p, 60, 59).G
    np.testing.assert_allclose(c[1:], G[1:, 59], rtol=0, atol=1e-12)


def test_known_closed_forms():
    p = np.array([0.8, 0.1])
    G = SequoiaTables(p, 6, 5).G
    assert G[2, 1] == pytest.approx(1.8)  # root + rank-1 child
    assert G[3, 1] == pytest.approx(1.9)  # root + two children
    assert G[3, 2] == pytest.approx(1 + 0.8 + 0.64)  # a chain beats a star here
    assert G[4, 1] == -np.inf  # width 2 cannot hold 3 children of the root


def simulate_tokens_per_step(parents: np.ndarray, p: np.ndarray, steps: int, rng: np.random.Generator) -> np.ndarray:
    """Positional acceptance: at each accepted node the k-th child is accepted with probability p_k."""
    n = len(parents)
    child_of = {}
    rank = np.zeros(n, dtype=int)
    for v in range(1, n):
        rank[v] = sum(1 for u in range(1, v) if parents[u] == parents[v])
        child_of[(parents[v], rank[v])] = v
    cumulative = np.concatenate([np.cumsum(p), [np.inf]])
    out = np.ones(steps)
    for i in range(steps):
        node = 0
        while True:
            k = int(np.searchsorted(cumulative, rng.random(), side="right"))
            nxt = child_of.get((node, k)) if k < len(p) else None
            if nxt is None:
                break
            node = nxt
            out[i] += 1
    return out


def test_monte_carlo_agrees_with_G():
    rng = np.random.default_rng(11)
    p = np.array([0.55, 0.12, 0.0, 0.06, 0.09, 0.02])
    tables = SequoiaTables(p, 24, 6)
    parents = tables.tree(24, 6)
    samples = simulate_tokens_per_step(parents, p, 40_000, rng)
    stderr = samples.std(ddof=1) / np.sqrt(len(samples))
    assert abs(samples.mean() - tables.value(24, 6)) < 3 * stderr


def test_invalid_sizes_raise():
    with pytest.raises(ValueError):
        SequoiaTables(np.array([0.5]), 0, 3)
    with pytest.raises(ValueError):
        SequoiaTables(np.array([0.5]), 4, -1)
    with pytest.raises(ValueError):
        SequoiaTables(np.array([0.5]), 4, 3).tree(4, 1)  # width 1, depth 1 holds 2 nodes only
