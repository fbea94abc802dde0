"""Sequoia's planner: the exact tree DP (numba), then the hardware-aware choice of the tree's size and depth.

The tree DP. Notation (the Sequoia paper, appendix C.2.2). p = (p_1..p_K) is the positional acceptance
vector: p_k is the probability that the k-th sampled child of an accepted node is accepted. A node's
score is the product of p_rank along its root path; a tree's value F is the sum of its node scores
(the root's 1 is the bonus token). T(m, l, b) is the best F over trees with exactly m nodes, at most l
levels, whose root has exactly b children ranked 1..b; G(n, d) = max_b T(n, d + 1, b).

Implementation. For a fixed level bound l, T(m, l, b) = 1 + S_b(m - 1) where S_b(r) is the best value of
b ranked child subtrees with r nodes in total, each at most l - 1 levels:

    S_0(0) = 0,  S_b(r) = max_{s >= 1} S_{b-1}(r - s) + p_b * M_{l-1}(s),   M_l(m) = max_b T(m, l, b).

This is the paper's recurrence with y = r - s + 1. It is evaluated as a max-plus convolution whose
innermost loop runs over r with s fixed: out[r] = max(out[r], prev[r - s] + v). That loop reads and
writes contiguous memory with no loop-carried reduction, so LLVM vectorises it (the loop over s inside
the loop over r, the textbook order, is a reduction that does not vectorise without fast-math and is
about 5x slower). Infeasible states are -inf and are never multiplied: sizes whose child value is -inf
are skipped, so 0 * -inf cannot produce a NaN.

The choice. For a tree of n nodes (root included) and depth d, one decoding step costs d draft forwards and one
target forward over n new tokens, and yields G(n, d) tokens on average:

    speedup(n, d) = G(n, d) * (t(1) + o(1)) / (t(n) + o(n) + d * c_draft)

the paper's G * t(1) / (t(n) + d c), with o(n), the decoding engine's time per step outside the target's forward
(mask, verification walk, commit), added where the profile measured it.
Without a profile the optimizer maximises G alone over n <= N, d <= D.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from numba import njit

from specplan.core.acceptance_schema import DraftChainTrace, SequoiaAcceptance, load_sequoia_acceptance
from specplan.core.choices import FORWARDS, MIN_SPEEDUP
from specplan.core.errors import UserError
from specplan.core.fileio import shown
from specplan.core.model_names import same_model
from specplan.core.plan_schema import BatchSchedule, Plan, PlanModels, Prediction, TokenTree
from specplan.core.profile_schema import LatencyProfile, load_profile
from specplan.core.provenance import provenance
from specplan.planner.draft_chain import CHAIN_KNOB_ENGINES, ChainKnobs, best_knobs, chain_schedule
from specplan.planner.engines import EngineRules, engine_rules

NEG_INF = -np.inf


@njit(cache=True)
def _max_plus_level(prev: np.ndarray, child: np.ndarray, weight: float, first: int, out: np.ndarray) -> None:
    """out[r] = max over s of prev[r - s] + weight * child[s], for r >= s + first (prev[x] = -inf below first)."""
    n = out.shape[0]
    out[:] = NEG_INF
    for s in range(1, n - first):
        c = child[s]
        if c == NEG_INF:
            continue
        v = weight * c
        # Fresh 1-D views with a unit stride and a zero base offset let LLVM vectorise the select.
        dst = out[s + first :]
        src = prev[first : n - s]
        for i in range(dst.shape[0]):
            cand = src[i] + v
            cur = dst[i]
            dst[i] = cand if cand > cur else cur


@njit(cache=True)
def _fill_tables(p: np.ndarray, max_size: int, max_levels: int) -> tuple[np.ndarray, np.ndarray]:
    """S[l, b, r] (b ranked children of total size r, each at most l - 1 levels) and M[l, m]."""
    width = min(p.shape[0], max(max_size - 1, 0))
    S = np.full((max_levels + 1, width + 1, max_size), NEG_INF)
    M = np.full((max_levels + 1, max_size + 1), NEG_INF)
    for l in range(1, max_levels + 1):
        S[l, 0, 0] = 0.0
        M[l, 1] = 1.0
        if l == 1:
            continue
        child = M[l - 1, :max_size]
        for b in range(1, width + 1):
            _max_plus_level(S[l, b - 1], child, p[b - 1], b - 1, S[l, b])
            for m in range(b + 1, max_size + 1):
                t = 1.0 + S[l, b, m - 1]
                if t > M[l, m]:
                    M[l, m] = t
    return S, M


@njit(cache=True)
def _depth_unbounded(p: np.ndarray, max_size: int) -> np.ndarray:
    """c(n) = best F over trees with exactly n nodes and any depth, for n = 0..max_size."""
    width = min(p.shape[0], max(max_size - 1, 0))
    S = np.full((width + 1, max_size), NEG_INF)
    c = np.full(max_size + 1, NEG_INF)
    S[0, 0] = 0.0
    for m in range(1, max_size + 1):
        best = 1.0
        for b in range(1, min(width, m - 1) + 1):
            t = 1.0 + S[b, m - 1]
            if t > best:
                best = t
        c[m] = best
        if m == max_size:
            break
        # Now every M(s <= m) is known: extend S_b to total size r = m.
        for b in range(1, width + 1):
            acc = NEG_INF
            for s in range(1, m - b + 2):
                prev = S[b - 1, m - s]
                if prev == NEG_INF:
                    continue
                cand = prev + p[b - 1] * c[s]
                if cand > acc:
                    acc = cand
            S[b, m] = acc
    return c


@njit(cache=True)
def _reconstruct(p: np.ndarray, S: np.ndarray, M: np.ndarray, size: int, levels: int) -> np.ndarray:
    """Parents (BFS order, children in rank order) of the best tree with `size` nodes and <= `levels` levels.

    Ties: the fewest root children b, then for the b-th child the smallest subtree.
    """
    parents = np.full(size, -1, dtype=np.int64)
    node_size = np.zeros(size, dtype=np.int64)
    node_levels = np.zeros(size, dtype=np.int64)
    node_size[0] = size
    node_levels[0] = levels
    sizes = np.zeros(S.shape[1], dtype=np.int64)
    count = 1
    for v in range(size):
        m = node_size[v]
        l = node_levels[v]
        if m == 1:
            continue
        best_b = 0
        best = NEG_INF
        for b in range(1, min(S.shape[1] - 1, m - 1) + 1):
            t = 1.0 + S[l, b, m - 1]
            if t > best:
                best = t
                best_b = b
        r = m - 1
        for b in range(best_b, 0, -1):
            target = S[l, b, r]
            chosen = -1
            for s in range(1, r - b + 2):
                c = M[l - 1, s]
                if c == NEG_INF:
                    continue
                if S[l, b - 1, r - s] + p[b - 1] * c == target:
                    chosen = s
                    break
            sizes[b - 1] = chosen
            r -= chosen
        for b in range(best_b):
            parents[count] = v
            node_size[count] = sizes[b]
            node_levels[count] = l - 1
            count += 1
    return parents


class SequoiaTables:
    """G(n, d) for all n <= max_size, d <= max_depth, and the optimal tree for any of them."""

    def __init__(self, positional: np.ndarray, max_size: int, max_depth: int) -> None:
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        if max_depth < 0:
            raise ValueError("max_depth must be >= 0")
        self.positional = np.ascontiguousarray(positional, dtype=np.float64)
        self.max_size = max_size
        self.max_depth = max_depth
        self._S, self._M = _fill_tables(self.positional, max_size, max_depth + 1)

    @property
    def G(self) -> np.ndarray:
        """G[n, d] for n in 0..max_size, d in 0..max_depth; -inf where no such tree exists (and n = 0)."""
        return self._M[1:, :].T.copy()

    def value(self, size: int, depth: int) -> float:
        return float(self._M[depth + 1, size])

    def tree(self, size: int, depth: int) -> np.ndarray:
        """Parents of an optimal tree with exactly `size` nodes and depth at most `depth`."""
        if not (1 <= size <= self.max_size and 0 <= depth <= self.max_depth):
            raise ValueError(f"(size={size}, depth={depth}) is outside the solved table")
        if not np.isfinite(self._M[depth + 1, size]):
            raise ValueError(f"no tree has {size} nodes within depth {depth} and width {len(self.positional)}")
        return _reconstruct(self.positional, self._S, self._M, size, depth + 1)


def depth_unbounded_values(positional: np.ndarray, max_size: int) -> np.ndarray:
    """c(n) for n in 0..max_size: the best expected tokens per step with n nodes and no depth limit."""
    return _depth_unbounded(np.ascontiguousarray(positional, dtype=np.float64), max_size)


LEVEL_LIMITED_MAX_DEPTH = 4  # the counted levels (2 and 3) a table carries; TensorRT-LLM's EAGLE engines: 4 layers


def _merge(prev: np.ndarray, child: np.ndarray, weight: float) -> np.ndarray:
    """out[r + s, a + c, b + d] = max(prev[r, a, b] + weight * child[s, c, d]): one more ranked child subtree,
    over tables indexed by [nodes, expanded nodes on level 2, on level 3] (-inf: no such subtree)."""
    out = np.full_like(prev, NEG_INF)
    size, e2, e3 = prev.shape
    for s, c, d in zip(*np.nonzero(np.isfinite(child))):
        if s == 0:
            continue
        candidate = prev[:size - s, :e2 - c, :e3 - d] + weight * child[s, c, d]
        region = out[s:, c:, d:]
        np.maximum(region, candidate, out=region)
    return out


class LevelLimitedTables:
    """G(n, d) over the trees that expand at most `max_expanded` nodes on each level (TensorRT-LLM's
    max_non_leaves_per_layer), exactly, for depths up to LEVEL_LIMITED_MAX_DEPTH.

    The subtree DP of SequoiaTables, with each table also indexed by the expanded nodes it holds on levels 2 and
    3 (W_k[m, e2, e3]: the best subtree of m nodes rooted on level k, its root's score 1), so that a merge adds
    the counts and drops what passes the limit. Level 1 needs no count: moving a subtree from one child of the
    root to a sibling of higher p changes no level's count and raises the value, so some optimal tree expands
    the e children of the root with the highest p (e <= max_expanded); the root is solved for each number of
    children c and each such e, the others leaves."""

    def __init__(self, positional: np.ndarray, max_size: int, max_depth: int, max_expanded: int) -> None:
        if max_depth > LEVEL_LIMITED_MAX_DEPTH:
            raise ValueError(f"a per-level limit is solved for depths up to {LEVEL_LIMITED_MAX_DEPTH}")
        self.positional = np.asarray(positional, dtype=np.float64)
        self.max_size, self.max_depth, self.max_expanded = max_size, max_depth, max_expanded
        self._G = np.full((max_size + 1, max_depth + 1), NEG_INF)
        self._G[1, :] = 1.0
        self._solved: dict[int, tuple] = {}
        for depth in range(1, max_depth + 1):
            best, choice, W, S, chains = self._solve(depth)
            self._G[:, depth] = np.maximum(self._G[:, depth], best)
            self._solved[depth] = (choice, W, S, chains)

    @property
    def G(self) -> np.ndarray:
        return self._G.copy()

    def _empty(self) -> np.ndarray:
        return np.full((self.max_size + 1, self.max_expanded + 1, self.max_expanded + 1), NEG_INF)

    def _solve(self, depth: int):
        """For trees of depth <= `depth`: the best value per size, the root's choice per size (children, the
        expanded ones, the chain row, the level-2 and level-3 counts), and the tables the trees are rebuilt from:
        W[level] the subtrees, S[level][b] a level's node with b children, chains the root's expanded children."""
        p, N = self.positional, self.max_size
        start = self._empty()
        start[0, 0, 0] = 0.0
        W: dict[int, np.ndarray] = {depth: self._empty()}
        W[depth][1, 0, 0] = 1.0
        S: dict[int, list[np.ndarray]] = {}
        for level in range(depth - 1, 0, -1):
            W[level] = self._empty()
            W[level][1, 0, 0] = 1.0
            S[level] = [start]
            for b in range(1, min(len(p), N - 1) + 1):
                S[level].append(_merge(S[level][-1], W[level + 1], p[b - 1]))
                grown = 1.0 + S[level][-1][:N]
                if level in (2, 3):  # this node is expanded: one more on its level
                    grown = _one_more_expanded(grown, axis=level - 1)
                np.maximum(W[level][1:], grown, out=W[level][1:])
        expanded_child = W[1].copy()
        expanded_child[1] = NEG_INF  # an expanded child of the root has children
        chains: dict[tuple[int, ...], np.ndarray] = {(): start}
        best = np.full(N + 1, NEG_INF)
        choice: dict[int, tuple] = {}
        for children in range(1, min(len(p), N - 1) + 1):
            order = tuple(sorted(range(children), key=lambda r: (-p[r], r)))
            for e in range(0, min(self.max_expanded, children) + 1 if depth > 1 else 1):
                key = order[:e]
                if key not in chains:
                    chains[key] = _merge(chains[key[:-1]], expanded_child, p[key[-1]])
                leaves = [r for r in range(children) if r not in key]
                base = 1 + len(leaves)
                value = 1.0 + float(p[leaves].sum()) + chains[key][:N + 1 - base]
                totals = value.reshape(len(value), -1).max(axis=1)
                for r in np.nonzero(totals > best[base:base + len(totals)])[0]:
                    best[base + r] = totals[r]
                    e2, e3 = np.unravel_index(int(np.argmax(value[r])), value[r].shape)
                    choice[base + r] = (children, key, r, int(e2), int(e3))
        return best, choice, W, S, chains

    def tree(self, size: int, depth: int) -> np.ndarray:
        """Parents (BFS order, children in rank order) of an optimal tree of `size` nodes and depth <= `depth`."""
        if not (1 <= size <= self.max_size and 0 <= depth <= self.max_depth) or not np.isfinite(self._G[size, depth]):
            raise ValueError(f"no tree of {size} nodes within depth {depth} under the limits")
        if size == 1:
            return np.array([-1], dtype=np.int64)
        solved_depth = next(d for d in range(1, depth + 1) if self._G[size, d] == self._G[size, depth])
        choice, W, S, chains = self._solved[solved_depth]
        children, key, r, e2, e3 = choice[size]
        p = self.positional
        expanded_child = W[1].copy()
        expanded_child[1] = NEG_INF
        states: dict[int, tuple[int, int, int]] = {}
        for j in range(len(key), 0, -1):  # peel the root's expanded children off their chain, last first
            s, c, d = _peel(chains[key[:j - 1]], expanded_child, p[key[j - 1]], chains[key[:j]][r, e2, e3], r, e2, e3)
            states[key[j - 1]] = (s, c, d)
            r, e2, e3 = r - s, e2 - c, e3 - d
        root = [(rank, states.get(rank, (1, 0, 0))) for rank in range(children)]
        parents = [-1]
        frontier = [(0, 1, root)]  # (node index, its level, its children's states in rank order)
        while frontier:
            next_frontier = []
            for node, level, kids in frontier:
                for _, (m, c, d) in kids:
                    parents.append(node)
                    child = len(parents) - 1
                    if m > 1:
                        next_frontier.append((child, level + 1, _children(W, S, p, level, m, c, d)))
            frontier = next_frontier
        return np.array(parents, dtype=np.int64)


def _one_more_expanded(table: np.ndarray, axis: int) -> np.ndarray:
    """`table` with its count on `axis` raised by one; what passes the limit (the axis's last index) is dropped."""
    shifted = np.full_like(table, NEG_INF)
    target, source = [slice(None)] * 3, [slice(None)] * 3
    target[axis], source[axis] = slice(1, None), slice(0, table.shape[axis] - 1)
    shifted[tuple(target)] = table[tuple(source)]
    return shifted


def _peel(prev: np.ndarray, child: np.ndarray, weight: float, value: float, r: int, e2: int, e3: int
          ) -> tuple[int, int, int]:
    """The last merged child's (nodes, level-2, level-3 counts) that made `value` at [r, e2, e3]."""
    for s, c, d in zip(*np.nonzero(np.isfinite(child))):
        if 1 <= s <= r and c <= e2 and d <= e3 and prev[r - s, e2 - c, e3 - d] + weight * child[s, c, d] == value:
            return int(s), int(c), int(d)
    raise AssertionError("no child state reproduces the table's value")


def _children(W: dict, S: dict, p: np.ndarray, level: int, m: int, e2: int, e3: int
              ) -> list[tuple[int, tuple[int, int, int]]]:
    """The ranked children's states of a level-`level` node whose subtree is W[level][m, e2, e3]."""
    own2, own3 = int(level == 2), int(level == 3)
    value = W[level][m, e2, e3]
    r, c2, c3 = m - 1, e2 - own2, e3 - own3
    b = next(b for b in range(1, len(S[level])) if 1.0 + S[level][b][r, c2, c3] == value)
    states = []
    for rank in range(b, 0, -1):
        s, c, d = _peel(S[level][rank - 1], W[level + 1], p[rank - 1], S[level][rank][r, c2, c3], r, c2, c3)
        states.append((rank - 1, (s, c, d)))
        r, c2, c3 = r - s, c2 - c, c3 - d
    return states[::-1]


def sglang_pool(positional: np.ndarray, steps: int, topk: int
                ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    """SGLang's EAGLE draft (python/sglang/srt/speculative/spec_utils.py: select_top_k_tokens) in the positional
    acceptance model: a node's k-th most likely child is accepted with probability p_k, and SGLang ranks drafted
    nodes by their draft score, the product of draft probabilities along the path, which falls with the rank. The
    model scores a child of rank k by q_k = min(p_1..p_k) (p itself where it falls with the rank, as a measured
    vector may not everywhere), so that no node outranks a lower-ranked sibling, as in SGLang:

    - step 1 drafts the root's top `topk` children; they are the frontier;
    - each later step expands every frontier node into its top `topk` children (topk^2 candidates, parent-major)
      and keeps the `topk` best of them, by score, as the next frontier;
    - every node drafted at any step (topk + (steps - 1) topk^2 of them) is a candidate.

    Returns the candidates' scores, their acceptance (the product of p along the path) and rank paths, in SGLang's
    order (step by step, parent-major, rank-minor). Ties between equal scores go to the earlier candidate, as a
    stable top-k would."""
    width = min(topk, len(positional))
    ranked = np.minimum.accumulate(positional)
    scores = [float(ranked[r]) for r in range(width)]
    accepted = [float(positional[r]) for r in range(width)]
    paths = [(r,) for r in range(width)]
    frontier = list(range(width))
    for _ in range(steps - 1):
        start = len(scores)
        for node in frontier:
            for r in range(width):
                scores.append(scores[node] * float(ranked[r]))
                accepted.append(accepted[node] * float(positional[r]))
                paths.append(paths[node] + (r,))
        order = sorted(range(start, len(scores)), key=lambda i: (-scores[i], i))
        frontier = order[:width]
    return np.array(scores), np.array(accepted), paths


def _kept(scores: np.ndarray, count: int) -> list[int]:
    """organize_draft_results: the `count` best candidates by score, earlier first among equals."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:count]


def sglang_selection(positional: np.ndarray, steps: int, topk: int, draft_tokens: int
                     ) -> tuple[float, list[tuple[int, ...]]]:
    """The tree SGLang verifies for (num_steps, topk, num_draft_tokens): organize_draft_results keeps the
    num_draft_tokens - 1 best-scoring candidates of the pool (sglang_pool). A child never outscores its parent
    nor a lower-ranked sibling, and ties go to the earlier candidate, so the kept set holds every kept node's
    ancestors, and a node's kept children are its top ranks. Returns the expected tokens per step (1 + the kept
    nodes' acceptance) and the kept nodes' rank paths."""
    scores, accepted, paths = sglang_pool(positional, steps, topk)
    kept = _kept(scores, draft_tokens - 1)
    return 1.0 + float(accepted[kept].sum()), [paths[i] for i in sorted(kept)]


class SGLangTables:
    """G(n, d) of SGLang's dynamic trees: n = num_draft_tokens (root included), d = num_steps, the best topk for
    each; like the other tables, G[n, d] is the best over at most d steps."""

    def __init__(self, positional: np.ndarray, max_size: int, max_depth: int, max_topk: int) -> None:
        self.max_size, self.max_depth = max_size, max_depth
        exact = np.full((max_size + 1, max_depth + 1), NEG_INF)
        exact[1, :] = 1.0
        self._choice: dict[tuple[int, int], tuple[int, int]] = {}  # (n, d) -> (steps, topk)
        for steps in range(1, max_depth + 1):
            for topk in range(1, min(max_topk, len(positional)) + 1):
                scores, accepted, _ = sglang_pool(positional, steps, topk)
                cumulative = 1.0 + np.cumsum(accepted[_kept(scores, len(scores))])
                for n in range(2, min(max_size, len(scores) + 1) + 1):
                    if cumulative[n - 2] > exact[n, steps]:
                        exact[n, steps] = cumulative[n - 2]
                        self._choice[n, steps] = (steps, topk)
        self._G = np.maximum.accumulate(exact, axis=1)
        self._positional = positional
        self._exact = exact

    @property
    def G(self) -> np.ndarray:
        return self._G.copy()

    def settings(self, size: int, depth: int) -> tuple[int, int, int]:
        """(num_steps, topk, num_draft_tokens) of the best tree with `size` nodes in at most `depth` steps."""
        steps = int(np.argmax(self._exact[size, :depth + 1]))
        return (*self._choice[size, steps], size)

    def tree(self, size: int, depth: int) -> np.ndarray:
        if size == 1:
            return np.array([-1], dtype=np.int64)
        steps, topk, _ = self.settings(size, depth)
        _, paths = sglang_selection(self._positional, steps, topk, size)
        return np.array(TokenTree.from_paths([list(p) for p in paths]).parents, dtype=np.int64)


Tables = SequoiaTables | LevelLimitedTables | SGLangTables  # one engine's G(n, d) and trees


def engine_tables(positional: np.ndarray, max_size: int, max_depth: int,
                  rules: EngineRules) -> Tables:
    """The table of G(n, d) over the trees `rules` allow: the exact DP on the acceptance vector cut to the engine's
    top-k (1 for a chain) with its depth cap, or with its limit of expanded nodes per level."""
    if rules.max_depth is not None:
        max_depth = min(max_depth, rules.max_depth)
    if rules.max_draft_tokens is not None:
        max_size = min(max_size, rules.max_draft_tokens + 1)
    width = rules.width(len(positional))
    if rules.shape == "sglang":
        return SGLangTables(positional, max_size, max_depth, width)
    if rules.max_non_leaves_per_level is not None:
        return LevelLimitedTables(positional[:width], max_size, max_depth, rules.max_non_leaves_per_level)
    return SequoiaTables(positional[:width], max_size, max_depth)


def prompt_prefill_per_token(acceptance: SequoiaAcceptance, profile: LatencyProfile) -> float | None:
    """The draft's prefill of each prompt (the profile's draft prefill, at the prompt lengths the acceptance file's
    chain traces record) over the tokens of the continuations: what a draft-model drafter pays per token beyond its
    steps, and one-token decoding does not. None where either file lacks it (unpriced)."""
    prompts = [(chain.prompt_tokens, len(chain.match)) for chain in acceptance.chains if chain.prompt_tokens]
    if not prompts or "draft" not in profile.prompt_prefills:
        return None
    return sum(profile.draft_prefill(length) for length, _ in prompts) / sum(tokens for _, tokens in prompts)


REPLAYED_CANDIDATES = 40  # the model's best (n, d) whose trees are replayed exactly over chain traces at T = 0


def replay_tree(parents: list[int] | np.ndarray, chains: list[DraftChainTrace]) -> float:
    """Tokens per step of a tree at T = 0 over the chain traces, exactly: from each step's first position the
    target's token at each depth is the child of that rank, if the tree has one (the draft's ranking there is the
    teacher-forced one, which the accepted path is); the target adds its own token after the last."""
    child = {}
    next_rank = [0] * len(parents)
    for v in range(1, len(parents)):
        child[(int(parents[v]), next_rank[parents[v]])] = v
        next_rank[parents[v]] += 1
    tokens = steps = 0
    for chain in chains:
        ranks, length, position = chain.ranks, len(chain.ranks), 0
        while position < length:
            node, accepted = 0, 0
            while position + accepted < length and (node, int(ranks[position + accepted])) in child:
                node = child[(node, int(ranks[position + accepted]))]
                accepted += 1
            gained = min(accepted + 1, length - position)
            tokens += gained
            steps += 1
            position += gained
    return tokens / steps


def _seconds_per_token(step_seconds: float, tokens_per_step: float, prefill_per_token: float, depth: int) -> float:
    """A tree step's time per token, with the draft's prompt prefill spread over the tokens
    (prompt_prefill_per_token) where the tree drafts at all (depth > 0): one-token decoding's step time over it is
    the speedup."""
    return step_seconds / tokens_per_step + (prefill_per_token if depth > 0 else 0.0)


def _replayed(ranked: list[Candidate], tables: Tables, chains: list[DraftChainTrace],
              one_token_seconds: float, prefill_per_token: float) -> list[Candidate]:
    """The model's best candidates with their trees' tokens per step replayed exactly (replay_tree), re-ranked."""
    replayed = []
    for c in ranked[:REPLAYED_CANDIDATES]:
        g = replay_tree(tables.tree(c.size, c.depth), chains)
        per_token = _seconds_per_token(c.step_seconds, g, prefill_per_token, c.depth)
        replayed.append(Candidate(c.size, c.depth, g, c.step_seconds, one_token_seconds / per_token, 1.0 / per_token))
    return sorted(replayed, key=lambda c: (-c.speedup, c.size, c.depth))


def plan_speedup(plan: Plan, profile: LatencyProfile) -> float:
    """A plan's tree priced on `profile` as the solver priced it: its tokens/step (replayed or modeled)
    over one step, t(n) + o(n) + d draft steps at the plan's context, plus the draft's prefill per token the plan
    recorded, against one-token decoding's t(1) + o(1). `plan bench --reprice` prices it on re-timed points."""
    context = plan.inputs["profile"]["context"]
    tree = plan.tree
    step = float(profile.step_seconds(tree.size, context)) + tree.depth * profile.draft_step(context)
    per_token = _seconds_per_token(step, plan.prediction.tokens_per_step,
                                  plan.prediction.details.get("draft_prefill_seconds_per_token") or 0.0, tree.depth)
    return float(profile.step_seconds(1, context)) / per_token


def tree_value(parents: np.ndarray, positional: np.ndarray) -> float:
    """F(T): the sum over nodes of the product of p_rank along the root path (BFS-ordered parents)."""
    score = np.zeros(len(parents))
    score[0] = 1.0
    next_rank = np.zeros(len(parents), dtype=np.int64)
    for v in range(1, len(parents)):
        parent = parents[v]
        rank = next_rank[parent]
        next_rank[parent] += 1
        score[v] = score[parent] * (positional[rank] if rank < len(positional) else 0.0)
    return float(score.sum())


@dataclass(frozen=True)
class Candidate:
    size: int
    depth: int
    tokens_per_step: float
    step_seconds: float | None = None
    speedup: float | None = None
    tokens_per_second: float | None = None


def rank_candidates(tables: Tables, profile: LatencyProfile | None = None,
                    context: int | None = None, rules: EngineRules | None = None,
                    prefill_per_token: float = 0.0) -> list[Candidate]:
    """Every non-dominated (n, d), best first: by speedup with a profile, by G without one. `prefill_per_token`:
    the draft's prompt prefill spread over the tokens of a continuation (prompt_prefill_per_token), added to each
    token's time (the same for every tree: it lowers the speedups, not their order).

    (n, d) is dropped when G(n, d) == G(n, d - 1): the deeper bound did not change the tree's value,
    so it only adds draft cost (the tree kept then has depth exactly d). Ties are broken towards smaller n, then
    smaller d. With an engine's `rules`, the depths below its least depth are dropped (its other limits are the
    table's: engine_tables).
    """
    G = tables.G
    sizes = np.arange(G.shape[0])
    feasible = np.isfinite(G)
    feasible[0, :] = False
    feasible[:, 1:] &= G[:, 1:] > G[:, :-1]
    if rules is not None:
        feasible[:, :min(rules.min_depth, G.shape[1])] = False
    if profile is None:
        candidates = [Candidate(int(n), int(d), float(G[n, d])) for n, d in zip(*np.nonzero(feasible))]
        return sorted(candidates, key=lambda c: (-c.tokens_per_step, c.size, c.depth))

    curve = profile.target_curve(context)
    c_draft = profile.draft_step(context)
    if c_draft is None:
        raise UserError("the profile has no draft.step_seconds: Sequoia needs the draft's per-step cost")
    max_n = min(tables.max_size, curve.max_n)
    feasible[max_n + 1:, :] = False
    t_one = float(profile.step_seconds(1, context))
    t_target = np.zeros(G.shape[0])
    t_target[1:max_n + 1] = profile.step_seconds(sizes[1:max_n + 1], context)
    out = []
    for n, d in zip(*np.nonzero(feasible)):
        step = t_target[n] + d * c_draft
        g = float(G[n, d])
        per_token = _seconds_per_token(step, g, prefill_per_token, int(d))
        out.append(Candidate(int(n), int(d), g, step, t_one / per_token, 1.0 / per_token))
    return sorted(out, key=lambda c: (-c.speedup, c.size, c.depth))


def solve_sequoia(acceptance_path: str | Path, max_size: int, max_depth: int, profile_path: str | Path | None = None,
                  context: int | None = None, engine: str = "specplan", heads: int | None = None,
                  batches: int | None = None, stand_in: bool = False, schedule_contexts: tuple[int, ...] = (),
                  min_speedup: float = MIN_SPEEDUP, output_tokens: int | None = None) -> tuple[Plan, list[Candidate]]:
    """The best tree `engine` executes (planner/engines.py), and the ranked (n, d) it was chosen from. For another
    engine than our own decoder the plan also records the unconstrained optimum, what the engine's rules cost.
    `batches`: a chain engine's plan also carries the draft length for every batch size up to this one, drafting only
    where predicted at least `min_speedup` times as fast as one-token decoding. `output_tokens`: solved for requests
    of that many new tokens (the chain traces cut to their first `output_tokens`; a draft model's prompt prefill is
    spread over fewer tokens the shorter its requests)."""
    if max_size < 1:
        raise UserError(f"the largest tree size must be >= 1, got {max_size}")
    if max_depth < 0:
        raise UserError(f"the largest tree depth must be >= 0, got {max_depth}")
    acceptance = load_sequoia_acceptance(acceptance_path)
    if output_tokens is not None:
        traced = acceptance.extra.get("max_new_tokens")
        if not acceptance.chains:
            raise UserError(f"--max-new-tokens cuts {acceptance_path}'s chain traces, and it has none")
        if isinstance(traced, int) and output_tokens > traced:
            raise UserError(f"--max-new-tokens {output_tokens}: {acceptance_path} traced {traced} new tokens a "
                            f"prompt; measure acceptance with --max-new-tokens {output_tokens} or solve for fewer")
        acceptance = acceptance.cut(output_tokens)
    # llama.cpp's plans are priced on its own forward and draft step (`plan profile --engine llama.cpp`), or on
    # llama-server's steps and its draft model's work (`plan profile --engine llama-server --draft`)
    backends = FORWARDS + ("llama.cpp", "llama-server") if engine == "llama.cpp" else FORWARDS
    profile = load_profile(profile_path, backends) if profile_path is not None else None
    models = _models(acceptance, profile, f"{acceptance_path} and {profile_path}", stand_in)

    rules = engine_rules(engine, heads)

    SequoiaTables(acceptance.positional, 2, 1)  # compile or load the numba cache outside the timing
    start = time.perf_counter()
    tables = engine_tables(acceptance.positional, max_size, max_depth, rules)
    dp_seconds = time.perf_counter() - start

    prefill = prompt_prefill_per_token(acceptance, profile) if profile is not None else None
    ranked = rank_candidates(tables, profile, context, rules, prefill or 0.0)
    # at T = 0 fixed trees replay exactly over the chain traces; SGLang's trees are grown anew each step
    replayable = (profile is not None and acceptance.temperature == 0 and bool(acceptance.chains)
                  and all(chain.ranks is not None for chain in acceptance.chains))
    exact = replayable and rules.shape != "sglang"
    one_token = float(profile.step_seconds(1, context)) if replayable else 0.0
    if exact and ranked:
        model_best = ranked[0]
        ranked = _replayed(ranked, tables, acceptance.chains, one_token, prefill or 0.0)
    if not ranked:
        raise UserError(f"no tree that {engine} runs fits the given size, depth and profile range")
    plan = _assemble_plan(tables, ranked[0], ranked, acceptance, acceptance_path, profile, profile_path, models,
                          max_size, max_depth, context)
    plan.solver["seconds"] = dp_seconds
    plan.prediction.details["draft_prefill_seconds_per_token"] = prefill  # None: unpriced
    if exact:
        plan.prediction = replace(plan.prediction, replay_exact=True)
        plan.solver["replayed"] = {"chains": len(acceptance.chains), "candidates": REPLAYED_CANDIDATES,
                                   "positional_model_best": asdict(model_best)}
    if rules.shape == "sglang":
        steps, topk, draft_tokens = tables.settings(ranked[0].size, ranked[0].depth)
        plan.solver["algorithm"] = "SGLang's dynamic-tree selection over (num_steps, topk, num_draft_tokens)"
        plan.solver["sglang"] = {"num_steps": steps, "topk": topk, "num_draft_tokens": draft_tokens}
    knobs = None  # the engine's own knobs, where it has them
    if engine in CHAIN_KNOB_ENGINES and acceptance.chains and profile is not None:
        knobs = _use_chain_knobs(plan, engine, acceptance, profile, max_depth, context)
    if engine != "specplan":
        free_tables = SequoiaTables(acceptance.positional, max_size, max_depth)
        free = rank_candidates(free_tables, profile, context, prefill_per_token=prefill or 0.0)
        unconstrained = (_replayed(free, free_tables, acceptance.chains, one_token, prefill or 0.0) if replayable
                         else free)[0]
        plan.engine = engine
        plan.solver["engine"] = {"name": engine, **rules.limits(),
                                 "sources": [str(source) for source in rules.sources],
                                 "unconstrained": asdict(unconstrained)}
    if batches is not None:
        _schedule_chain(plan, rules, acceptance, profile, batches, max_depth, context, schedule_contexts, min_speedup,
                        knobs if engine == "llama.cpp" else None)
    elif schedule_contexts:
        raise UserError("--contexts prices a schedule per batch size at each context: it goes with --batches")
    if output_tokens is not None:
        plan.inputs["acceptance"]["output_tokens"] = output_tokens
    if stand_in:
        plan.inputs["acceptance"]["stands_in"] = (f"measured for {acceptance.target} + {acceptance.draft}, standing "
                                                  f"in for {models.target} + {models.draft}")
    return plan, ranked


def _schedule_chain(plan: Plan, rules: EngineRules, acceptance: SequoiaAcceptance, profile: LatencyProfile | None,
                    batches: int, max_depth: int, context: int | None, contexts: tuple[int, ...],
                    min_speedup: float, knobs: ChainKnobs | None) -> None:
    """The chain's draft length per batch size (planner/draft_chain.py: chain_schedule), one table per context of
    `contexts` if given; the plan's chain grows to the longest the schedule drafts (an off entry's candidate included),
    its batch-1 prediction kept. `knobs`: llama-server's batch-1 setting, whose n-min and p-min its export sets beside
    each concurrency's draft length (priced so: planner/draft_chain.py, chain_schedule)."""
    if rules.shape != "chain":
        raise UserError("--batches schedules a draft model's chain, the table vLLM and TensorRT-LLM take: solve with "
                        "--engine vllm, trtllm-draft or llama.cpp")
    if profile is None:
        raise UserError("--batches prices each batch size: give a --profile measured with --batches")
    if acceptance.temperature != 0 or not acceptance.chains:
        raise UserError("--batches replays the acceptance file's chain traces, recorded at temperature 0")
    largest_depth = min(max_depth, rules.max_draft_tokens or max_depth)
    prefill = prompt_prefill_per_token(acceptance, profile) or 0.0
    tables = [chain_schedule(acceptance.chains, profile, batches, largest_depth, at, prefill, min_speedup, knobs)
              for at in (sorted(contexts) or [context])]
    schedule, rates = BatchSchedule.by_context([table for table, _ in tables]), tables[0][1]
    drafted = max(entry.nodes(gated=True) - 1 for table in schedule.tables for entry in table.entries)
    if drafted > plan.tree.depth:
        plan.tree = TokenTree.from_parents(list(range(-1, drafted)))
    plan.schedule = schedule
    replayed = ("" if knobs is None else f" with llama-server's n-min {knobs.draft_min} and p-min {knobs.p_min}, a "
                "step priced as its slots' mix of rows and draft decodes")
    plan.solver["schedule"] = {"algorithm": "the most output tokens/s over the batch at every batch size, each draft "
                                            f"length replayed over the chain traces{replayed}",
                               "min_speedup": min_speedup, "tokens_per_second": rates,
                               "largest_fitting_batch": profile.largest_fitting_batch(schedule.context)}


def _use_chain_knobs(plan: Plan, engine: str, acceptance: SequoiaAcceptance, profile: LatencyProfile,
                     max_depth: int, context: int | None) -> ChainKnobs:
    """Replace the chain DP's choice by the engine's own knobs replayed over the chain traces (planner/draft_chain.py):
    the plan's chain is the draft length, its prediction the replay's; where no setting is predicted faster than
    one-token decoding, the plan drafts nothing (and records the best setting, which `plan bench` still runs).
    Returns that best setting."""
    ranked = best_knobs(engine, acceptance.chains, profile, max_depth, context)
    best = ranked[0]
    enabled = bool(best.speedup > 1.0)
    plan.solver["algorithm"] = f"{engine}'s drafting rule replayed over {len(acceptance.chains)} chain traces"
    plan.solver["chain_knobs"] = {"enabled": enabled, "best": best.as_dict(),
                                  "top": [knobs.as_dict() for knobs in ranked[1:6]]}
    if not enabled:
        plan.tree = TokenTree.from_parents([-1])
        step = float(profile.step_seconds(1, context))
        plan.prediction = Prediction(1.0, 1.0, step, 1.0 / step, latency_source=profile.source)
        return best
    plan.tree = TokenTree.from_parents(list(range(-1, best.draft_max)))
    plan.prediction = Prediction(best.tokens_per_step, best.speedup, best.step_seconds,
                                 best.tokens_per_step / best.step_seconds, latency_source=profile.source,
                                 replay_exact=True)
    return best


def _models(acceptance: SequoiaAcceptance, profile: LatencyProfile | None, files: str,
            stand_in: bool = False) -> PlanModels:
    """The plan's models: the acceptance file's, which the profile's must be; with `stand_in`, the profile's (the
    acceptance of another pair standing in for theirs, e.g. on a modeled GPU)."""
    models = {"target": acceptance.target, "draft": acceptance.draft}
    if stand_in:
        if profile is None:
            raise UserError("--stand-in prices another pair's acceptance on a profile's models: give --profile")
        models = {role: profile.models.get(role) or "" for role in models}
    if profile is not None:
        if profile.draft_vocab != acceptance.draft_vocab and not stand_in:
            raise UserError(f"{files}: the acceptance file's draft vocabulary ({acceptance.draft_vocab or 'all'}) "
                            f"differs from the one the profile timed ({profile.draft_vocab or 'all'}): measure both "
                            "with the same draft vocabulary")
        for role in ("target", "draft"):
            measured = profile.models.get(role)
            if measured and models[role] and not same_model(measured, models[role]):
                raise UserError(f"{files}: the acceptance file is for {role} {shown(models[role])} but the profile "
                                f"for {shown(measured)}")
            models[role] = models[role] or measured
    return PlanModels(target=models["target"] or None, draft=models["draft"] or None,
                      dtype=profile.dtype or None if profile is not None else None,
                      draft_dtype=profile.draft_dtype or None if profile is not None else None,
                      draft_vocab=profile.draft_vocab if stand_in else acceptance.draft_vocab,
                      backend=profile.backend if profile is not None else None)


def _assemble_plan(tables: Tables, best: Candidate, ranked: list[Candidate],
                   acceptance: SequoiaAcceptance,
                   acceptance_path: str | Path, profile: LatencyProfile | None, profile_path: str | Path | None,
                   models: PlanModels, max_size: int, max_depth: int, context: int | None) -> Plan:
    """The plan file for the chosen (n, d): its tree, prediction, and the inputs `plan show` redraws it from."""
    tree = TokenTree.from_parents(tables.tree(best.size, best.depth))
    prediction = Prediction(best.tokens_per_step, best.speedup, best.step_seconds, best.tokens_per_second,
                            latency_source=profile.source if profile is not None else None)
    inputs: dict = {
        "acceptance": {"file": str(acceptance_path), "positional": [float(x) for x in acceptance.positional]},
        "max_size": max_size, "max_depth": max_depth,
    }
    if profile is not None:
        curve = profile.target_curve(context)
        inputs["profile"] = {
            **profile.plan_inputs(profile_path), "context": context if context is not None else profile.target_context,
            "target_t_seconds": {int(n): float(t) for n, t in curve.points.items()},
            "draft_step_seconds": profile.draft_step(context),
            **({"engine_overhead_seconds": dict(profile.overhead_seconds)} if profile.overhead_seconds else {}),
        }
    sampling = {k: v for k, v in (("temperature", acceptance.temperature), ("top_p", acceptance.top_p))
                if v is not None}
    return Plan(
        method="sequoia",
        models=models,
        prediction=prediction,
        inputs=inputs,
        solver={"seconds": 0.0, "algorithm": "depth-bounded tree DP (numba)",
                "width": len(acceptance.positional),
                "top": [asdict(c) for c in ranked[:10]]},
        provenance=provenance([acceptance_path] + ([profile_path] if profile_path else [])),
        sampling=sampling,
        tree=tree,
    )
