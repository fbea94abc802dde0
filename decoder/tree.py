"""Token trees as the decoder moves them: what a drafter proposes and the target scores in one forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit

# How a drafter chose each node's children; the verification rule must match it.
WITHOUT_REPLACEMENT = "without_replacement"  # sampled from Q without replacement (Gumbel-top-k), Sequoia
WITH_REPLACEMENT = "with_replacement"  # sampled i.i.d. from Q, SpecInfer
DETERMINISTIC = "deterministic"  # no draft distribution: top-k of Q, or a trie


@dataclass
class DraftTree:
    """Node 0 is the root: the last committed token, not yet in the target's cache. Nodes are in BFS order
    (a parent precedes its children); the children of a node are in the order they were drawn."""

    tokens: list[int]
    parents: list[int]
    draw: str = DETERMINISTIC
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> Q its children were drawn from

    def __post_init__(self) -> None:
        self.depths = [0] * len(self.parents)
        self.children: list[list[int]] = [[] for _ in self.parents]
        for v in range(1, len(self.parents)):
            self.depths[v] = self.depths[self.parents[v]] + 1
            self.children[self.parents[v]].append(v)

    @property
    def size(self) -> int:
        return len(self.tokens)


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """allowed[v, u] = u is v or an ancestor of v (parents precede children)."""
    # Built for every new tree shape (each Lookahead step): compiled, a 32-node tree takes microseconds.
    return torch.from_numpy(_ancestors(np.asarray(parents, dtype=np.int64)))


@njit(cache=True)
def _ancestors(parents: np.ndarray) -> np.ndarray:
    n = len(parents)
    allowed = np.zeros((n, n), dtype=np.bool_)
    for v in range(n):
        if v:
            allowed[v] = allowed[parents[v]]  # a parent precedes its children
        allowed[v, v] = True
    return allowed


def tree_attention_mask(allowed: torch.Tensor, prefix: int, dtype: torch.dtype,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask [rows, prefix + n]: every row sees the whole prefix and its ancestors in the tree."""
    block = allowed if rows is None else allowed[rows]
    mask = torch.zeros(block.shape[0], prefix + allowed.shape[1], dtype=dtype)
    mask[:, prefix:].masked_fill_(~block, float("-inf"))
    return mask
