"""Per request, per step: draft or not, from what the request's own drafts have been yielding.

A plan predicts the tokens a drafted step emits (its acceptance, measured on the workload it was solved on) and the
speedup that buys over one-token decoding on the profiled machine, per batch size. A request whose text is unlike
that workload yields some fraction r of the predicted tokens, and drafting pays for it only while r x speedup >= 1:
the drafted step costs what the profile says whatever it yields. Each request keeps its r as a running average over
its drafted steps (the plan's own prediction, r = 1, before the first); below break-even it steps without drafting
(the root alone: exact as any tree is, so greedy output and the sampled distribution are those of the target) and
drafts again every PROBE_EVERY steps to see whether its text has turned predictable. How much it drafts when it
does is the plan's setting at the step's batch size and the request's context (its schedule's entry).
"""

from __future__ import annotations

from collections.abc import Callable

# The weight of a drafted step's yield in the request's running average: about the last 3-4 drafted steps count, so
# that a request turns drafting off within a few steps of its drafts failing (a reply of 64 tokens has 30-60 steps)
YIELD_WEIGHT = 0.3
# Steps without drafting after which a request drafts once more: a probe costs one drafted step in this many
PROBE_EVERY = 8

# (batch size, the request's context) -> (predicted tokens per step, speedup) or None
Pricing = Callable[[int, int], "tuple[float, float] | None"]


class DraftGate:
    """One request's decisions: `drafts(batch, context)` before a step, `observe(emitted)` after it."""

    def __init__(self, pricing: Pricing) -> None:
        self.pricing = pricing
        self.yield_ratio = 1.0  # the request's tokens per drafted step over the plan's prediction, running average
        self.idle_steps = 0
        self.priced: tuple[float, float] | None = None  # the prediction of the step being decided
        self.drafting = True

    def drafts(self, batch: int, context: int) -> bool:
        """Whether the request (`context` tokens so far) drafts at the coming step of `batch` sequences."""
        self.priced = self.pricing(batch, context)
        if self.priced is None:  # nothing priced (or the schedule off there): the drafter's setting decides
            self.drafting = True
        elif self.yield_ratio * self.priced[1] >= 1.0 or self.idle_steps + 1 >= PROBE_EVERY:
            self.drafting, self.idle_steps = True, 0
        else:
            self.drafting, self.idle_steps = False, self.idle_steps + 1
        return self.drafting

    def observe(self, emitted: int) -> None:
        """The step just verified emitted `emitted` tokens (the accepted drafts and the target's next token)."""
        if self.drafting and self.priced is not None:
            self.yield_ratio += YIELD_WEIGHT * (emitted / self.priced[0] - self.yield_ratio)
