"""Per request, per step: draft or not, from what the request's own drafts have been yielding.

A plan predicts the tokens a drafted step emits (its acceptance, measured on the workload it was solved on) and the
speedup that buys over one-token decoding on the profiled machine, per batch size; a drafted step therefore costs
tokens / speedup plain steps. A request whose text is unlike that workload yields some fraction r of the predicted
tokens, and drafting pays for it only while r x speedup >= 1. Each request keeps its r as the mean over its last
YIELD_WINDOW drafted steps and PRIOR_STEPS steps at the plan's own prediction (r = 1 before the first); below
break-even it steps without drafting (the root alone: exact as any tree is, so greedy output and the sampled
distribution are those of the target) and drafts once more after PROBE_EVERY drafted steps' price spent on plain ones,
to see whether its text has turned predictable. With an engine's clock, the requests sitting out probe together, at
the steps numbered a multiple of that period: a probe costs the whole step a draft forward (a draft model's, a
TriForce chain's), so one forward serves every probe of the batch instead of one each. A step whose drafter had
nothing to propose (a trie without a match) cost a plain step and does not count. How much it drafts when it does is
the plan's setting at the step's batch size and the request's context (its schedule's entry).

A drafted step's price is the plan's until the engine has timed both kinds of step at that batch size (StepClock,
which has the first steps at each batch size drafted, then plain, until it has timed a few of each): then it is their
measured ratio, which carries what no profile does: the server's own work between steps, and the spell the machine
is in (a VM's slow spells slow a one-row step over a long context more than a drafted step's many rows).

Why a plain mean: a step's yield is skewed (most drafted steps emit one or two tokens, a few emit many), so an average
that weighs the last steps most sits below its mean most of the time and declines drafts that pay on average
(`bench/gate_replay.py` prices both on the plan's own prediction).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable

# The drafted steps a request's yield is averaged over: few enough that a request whose text turns unpredictable stops
# drafting within a few steps (a reply of 64 tokens has 30-60 steps), enough that one unlucky step does not stop it
YIELD_WINDOW = 8
# Pseudo-steps at the plan's prediction in that mean: a request's first drafted step alone does not decide
PRIOR_STEPS = 2
# A request that sits steps out drafts once more after spending this many drafted steps' price on plain steps: a probe
# costs at most 1 / PROBE_EVERY of the time whatever a drafted step costs (a 7-token TriForce chain or a 3-row trie
# tree)
PROBE_EVERY = 8
# The steps of each kind (every sequence drafting, none) a batch size's measured price is the median of: recent enough
# to follow the machine's spells, enough to ride out a step that the OS or a prefill elsewhere slowed
MEASURED_STEPS = 16
# Steps of each kind timed before their ratio replaces the plan's price
MEASURED_AT_LEAST = 4

# (batch size, the request's context) -> (predicted tokens per step, speedup) or None
Pricing = Callable[[int, int], "tuple[float, float] | None"]


class StepClock:
    """What the engine's decoding steps cost now, per batch size: the seconds from one step's start to the next's, of
    steps in which every sequence drafted and of steps in which none did (steps that shared the machine with a
    prompt's prefill are not timed; decoder/batching.py)."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[int, bool], deque[float]] = {}
        self.step = 0  # the steps begun: the requests sitting out probe together at multiples of their period
        self.start_rates: deque[float] = deque(maxlen=MEASURED_STEPS)  # a drafter's start: seconds per token read

    def begin_step(self) -> None:
        self.step += 1

    def record(self, batch: int, drafted: bool, seconds: float) -> None:
        self.seconds.setdefault((batch, drafted), deque(maxlen=MEASURED_STEPS)).append(seconds)

    def wanted(self, batch: int) -> bool | None:
        """The kind of step at `batch` sequences still to be timed (True: a drafted one), drafted first; None once
        both are. Every request in a step reads the same answer, so the step is of one kind."""
        for drafted in (True, False):
            if len(self.seconds.get((batch, drafted), ())) < MEASURED_AT_LEAST:
                return drafted
        return None

    def record_start(self, tokens: int, seconds: float) -> None:
        """A drafter's start: `tokens` read (a draft model's prompt) in `seconds`."""
        if tokens > 0:
            self.start_rates.append(seconds / tokens)

    def start_cost(self, batch: int, tokens: int) -> float | None:
        """A start reading `tokens`, in plain steps at `batch` sequences; None before both are measured."""
        plain = self.seconds.get((batch, False), ())
        if not self.start_rates or len(plain) < MEASURED_AT_LEAST:
            return None
        return tokens * statistics.median(self.start_rates) / statistics.median(plain)

    def drafted_step_cost(self, batch: int) -> float | None:
        """A drafted step's price in plain steps at `batch` sequences, as measured; None before both kinds are."""
        drafted, plain = self.seconds.get((batch, True), ()), self.seconds.get((batch, False), ())
        if min(len(drafted), len(plain)) < MEASURED_AT_LEAST:
            return None
        return statistics.median(drafted) / statistics.median(plain)


class DraftGate:
    """One request's decisions: `drafts(batch, context)` before a step, `observe(emitted, drafted)` after it."""

    def __init__(self, pricing: Pricing, clock: StepClock | None = None) -> None:
        self.pricing = pricing
        self.clock = clock  # the engine's measured step costs; None: the plan's price alone
        self.yields: deque[float] = deque(maxlen=YIELD_WINDOW)  # its drafted steps' tokens over the prediction
        self.idle_steps = 0
        self.priced: tuple[float, float] | None = None  # the prediction of the step being decided
        self.drafting = True

    @property
    def yield_ratio(self) -> float:
        """r: the request's tokens per drafted step over the plan's prediction (1 before its first)."""
        return (PRIOR_STEPS + sum(self.yields)) / (PRIOR_STEPS + len(self.yields))

    def drafts(self, batch: int, context: int, start_tokens: int = 0, remaining: int | None = None) -> bool:
        """Whether the request (`context` tokens so far, `remaining` still to emit) drafts at the coming step of
        `batch` sequences; its drafter reads `start_tokens` first if it does (a draft model's prompt, not read yet)."""
        self.priced = self.pricing(batch, context)
        if self.priced is None:  # nothing priced (or the schedule off there): the drafter's setting decides
            self.drafting = True
            return True
        tokens, speedup = self.priced
        measured = self.clock.drafted_step_cost(batch) if self.clock is not None else None
        step_cost = measured if measured is not None else tokens / speedup  # a drafted step in plain steps
        if start_tokens and remaining is not None and not self._start_pays(batch, start_tokens, remaining, tokens,
                                                                           step_cost):
            self.drafting, self.idle_steps = False, self.idle_steps + 1
            return False
        wanted = self.clock.wanted(batch) if self.clock is not None else None
        if wanted is not None:  # the few steps that time each kind, once per batch size
            self.drafting = wanted
            return wanted
        if self.yield_ratio * tokens >= step_cost or self._probe_due(step_cost):
            self.drafting, self.idle_steps = True, 0
        else:
            self.drafting, self.idle_steps = False, self.idle_steps + 1
        return self.drafting

    def _start_pays(self, batch: int, start_tokens: int, remaining: int, tokens: float, step_cost: float) -> bool:
        """Whether drafting the `remaining` tokens can save more plain steps than the drafter's start costs: each
        drafted step emits r x tokens for step_cost plain steps, so drafting them all saves remaining x (1 - step_cost
        / (r x tokens)) plain steps. Unpriced (True) until the clock has timed a start and plain steps here."""
        cost = self.clock.start_cost(batch, start_tokens) if self.clock is not None else None
        if cost is None:
            return True
        return remaining * (1.0 - step_cost / (self.yield_ratio * tokens)) > cost

    def _probe_due(self, step_cost: float) -> bool:
        """Whether a request sitting steps out drafts at the coming one: PROBE_EVERY drafted steps' price spent on
        plain steps; with a clock, at the steps numbered a multiple of that period, at least half of it since its last
        draft (every request of the step reads the same period: the same batch size and clock)."""
        if self.clock is None:
            return self.idle_steps + 1 >= PROBE_EVERY * step_cost
        period = max(1, math.ceil(PROBE_EVERY * step_cost))
        return self.clock.step % period == 0 and self.idle_steps + 1 >= period // 2

    def observe(self, emitted: int, drafted: int) -> None:
        """The step just verified scored `drafted` draft tokens and emitted `emitted` (the accepted drafts and the
        target's next token)."""
        if self.drafting and self.priced is not None and drafted > 0:
            self.yields.append(emitted / self.priced[0])
