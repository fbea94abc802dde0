"""The target's and drafts' token distributions: temperature, then top-k, then top-p (transformers' order).

The decoder, the acceptance profiler and the tests all draw from these functions, so the distribution the
decoder samples from is the one its statistics were measured for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specplan.core.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Row-wise distributions (float32) after temperature, top-k and top-p. Greedy gives one-hot argmax rows."""
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # the smallest prefix with mass >= top_p survives
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs`."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
