"""Per step: how long a chain the batch's TriForce hierarchies draft, from what their chains have been yielding and
what their steps have cost.

A TriForce schedule prices every chain length it chose among at each batch size (core/plan_schema.py: ChainLength):
its tokens per step, replayed over the plan's acceptance traces, and its speedup over one-token decoding, so a drafted
step of that length costs tokens / speedup plain steps. The length a schedule's entry names is the best on those
traces and that profile; on a load whose chains land less far than the traces', a shorter one emits nearly as much
for less. The middle level's rounds collect a chain, and a shorter setting stops at an earlier round's end, so the
chain it would have drafted is a prefix of the one drafted (the same tokens at T = 0, the rounds being deterministic;
sampled, the same in distribution), and what it would have emitted is read off every drafted step: one plus the
accepted drafts, up to the prefix's end (Drafter.prefix_yields). Each length keeps the mean of its last LENGTH_WINDOW
such yields, whichever requests drafted them, beside LENGTH_PRIOR pseudo-steps at the traces' tokens per step.

A length's price is the plan's, corrected by the steps of it the engine timed: each timed drafted step's seconds over
its price (in the plain steps the engine's clock timed at that batch size) is that length's price error, and a
length's price is the plan's times the median of its last errors (those of the nearest length timed, in nodes, where
it has too few; none timed: the plan's). The profile's prices of neighbouring lengths can be off by more than what
separates them (a short chain's fewer middle rounds priced dearer or cheaper than they run), and only the lengths
drafted are timed: a length chosen on the plan's price is timed as it runs, and left if it costs more.

Each step drafts, up to the entry's length, the length whose mean yield over its price is highest (ties to the
longer). A length longer than the one chosen is not seen while it is not drafted: its mean stays as last measured,
and the batch drafts the entry's length again, to refresh it, at the steps numbered a multiple of the period at
which such steps cost at most LENGTH_PROBE_SHARE of the time, at the loss the means predict for them.

Which length a step drafts changes nothing the verification sees: every chain is verified as any tree is, so greedy
output and the sampled distribution are the target's whatever the length.
"""

from __future__ import annotations

import statistics
from collections import deque

from specplan.core.plan_schema import ChainLength
from specplan.decoder.gate import MEASURED_AT_LEAST, MEASURED_STEPS, UNTIMED_FIRST_STEPS, probe_period

# The drafted sequence-steps each length's mean yield is taken over: the chains of one request or a few (64-128 tokens
# each at 2-6 tokens a step), enough that a 2-3% difference between neighbouring lengths stands out of a step's spread
# (one to all of a chain's tokens)
LENGTH_WINDOW = 256
# Pseudo-steps at the traces' tokens per step in each length's mean: a length's first few yields alone do not decide
LENGTH_PRIOR = 16
# The share of the time the steps refreshing a longer length than the one chosen may cost: under the 3% within which
# a schedule must hold its best fixed setting, since the shorter length is chosen to win about that much
LENGTH_PROBE_SHARE = 0.01


class ChainLengths:
    """The engine's: `begin_step()`, then `choose(...)` for each sequence about to draft; `observe(...)` after its
    step, and `timed(...)` once the step's time is known."""

    def __init__(self) -> None:
        self.yields: dict[int, deque[int]] = {}  # nodes -> the tokens its prefix of each drafted chain emitted
        self.errors: dict[int, deque[float]] = {}  # nodes -> its timed steps' seconds over their plan's price
        self.seen: dict[int, int] = {}  # nodes -> its drafted steps timed, the first UNTIMED_FIRST_STEPS left out
        self.step = 0

    def begin_step(self) -> None:
        self.step += 1

    def mean_yield(self, length: ChainLength) -> float:
        seen = self.yields.get(length.decoding_length, ())
        return (LENGTH_PRIOR * length.tokens_per_step + sum(seen)) / (LENGTH_PRIOR + len(seen))

    def price_error(self, nodes: int) -> float:
        """The measured price of a length over the plan's: its own timed steps', else the nearest length's timed
        (the longer of two as near), else 1."""
        timed = [n for n, errors in self.errors.items() if len(errors) >= MEASURED_AT_LEAST]
        near = min(timed, key=lambda n: (abs(n - nodes), -n), default=None)
        return statistics.median(self.errors[near]) if near is not None else 1.0

    def choose(self, lengths: tuple[ChainLength, ...], batch: int, nodes: int) -> ChainLength | None:
        """The length to draft at this step of `batch` sequences, up to `nodes` per sequence (root included: the
        schedule's entry's), among the priced `lengths`; None where they price none of `nodes` (the entry's holds)."""
        options = {length.decoding_length: length for length in lengths if length.decoding_length <= nodes}
        if nodes not in options:
            return None
        gain = {n: self.mean_yield(length) * length.price_at(batch)[1] / (length.tokens_per_step * self.price_error(n))
                for n, length in options.items()}  # tokens per plain step's time
        best = max(gain, key=lambda n: (gain[n], n))
        if best != nodes:  # the entry's length refreshed at the steps its loss's period numbers
            if self.step % probe_period(1.0 - gain[nodes] / gain[best], LENGTH_PROBE_SHARE) == 0:
                best = nodes
        return options[best]

    def observe(self, prefix_yields: dict[int, int]) -> None:
        """A drafted chain's tokens emitted had it stopped at each length (nodes -> tokens; Drafter.prefix_yields)."""
        for nodes, tokens in prefix_yields.items():
            self.yields.setdefault(nodes, deque(maxlen=LENGTH_WINDOW)).append(tokens)

    def timed(self, nodes: int, plain_steps: float, price: float) -> None:
        """A drafted step of `nodes` per sequence took `plain_steps` of the engine's plain steps at its batch size,
        where the plan prices it at `price`."""
        self.seen[nodes] = self.seen.get(nodes, 0) + 1
        if self.seen[nodes] > UNTIMED_FIRST_STEPS:
            self.errors.setdefault(nodes, deque(maxlen=MEASURED_STEPS)).append(plain_steps / price)
