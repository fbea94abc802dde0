"""Per request, per step: draft or not, from what the request's own drafts have been yielding.

A plan predicts the tokens a drafted step emits (its acceptance, measured on the workload it was solved on) and the
speedup that buys over one-token decoding on the profiled machine, per batch size; a drafted step therefore costs
tokens / speedup plain steps. A request whose text is unlike that workload yields some fraction r of the predicted
tokens, and drafting pays for it only while r x speedup >= 1. Each request keeps its r as the mean over its last
YIELD_WINDOW drafted steps and PRIOR_STEPS steps at its prior (before the first, r is its prior); below
break-even it steps without drafting (the root alone: exact as any tree is, so greedy output and the sampled
distribution are those of the target). A drafter whose drafts cost no forward (a trie) still drafts at the steps it
sits out, in the shadow: nothing is scored, and the text that follows tells what each such draft would have emitted,
which enters the same mean, so the request resumes as soon as its text turns predictable. A TriForce chain's trie
bottom does so for the price: the middle rounds its first-round drafts say a chain would take join the request's own
(_own_passes), so that a request that sat out on its first chains' dear rounds sees its text turn copyable at once,
not at a probe every few dozen steps. Any other drafts once more,
to see whether it has, when such probes cost at most PROBE_SHARE of the time it sits out, as its own r expects them to:
a probe's step costs its price less the tokens r expects of it, so a request just under break-even probes often (its
yield swings across the line from step to step; docs/design.md), one whose drafts fail outright seldom. With an
engine's clock, the requests sitting out probe together, at the steps numbered a multiple of their probe period, a
power of two so that the periods of requests at different yields nest: a probe costs the whole step a draft forward
(a draft model's, a TriForce chain's), so one forward serves every probe of the batch instead of one each. A probe is
priced as a lone drafter's step where the plan priced a step's mix (DraftGate.mix_cost): at B = 8 a lone TriForce chain
cost the batch 8-11 plain steps of its requests' where a share of a drafted step is 5.4. A step
whose drafter had nothing to propose (a trie without a match) cost a plain step alone and does not count; beside
other sequences it rode the batch's drafted step (the clock times such a step as drafted) and counts as the one token
it emitted: a plan's tokens per step count such steps too, and counting only matched steps beside others would
overstate r. A shadow step without a match counts the same way (beside others, as one token). A step whose drafter
cannot draft yet (a TriForce sequence's first: `not_ready`) is a plain step and counts nothing.
How much it drafts when it does is the plan's setting at the step's batch size and the request's context (its
schedule's entry).

A request's prior is the plan's own prediction (r = 1), or, for a request joining a batch in flight, the mean r of
the batch's requests at its last step (Scheduler): the load in flight is the best evidence of the next request's, and
joiners at the plan's r would outvote a batch whose drafts miss (settle_step), each batch of them paying a drafted
step to learn what the batch knew. A request joining an idle engine takes the mean of the engine's last YIELD_WINDOW
drafted steps (any request's, within RECENT_STEPS of the engine's steps) beside PRIOR_STEPS at the plan's
(RecentYields), from its first step: one request at a time, each paying a drafted step at the plan's r to learn what
the last ones knew held an unseen TriForce load at C = 1 to 0.96 of one-token decoding (docs/benchmark-log.md: "An idle
engine's evidence from the first step"). So does one joining a batch none of whose requests has drafted yet, and each
follows those steps as they come until its own first drafted step counts; of a burst with none to go by at all (a
fresh engine's: `uninformed`), one drafts a step for the rest (settle_step), whose first decisions then follow its
yield: each of an unseen TriForce load's bursts at C = 8 drafted a step of 3 s at the plan's r, eight chains missing
together (docs/benchmark-log.md: "One drafts for a fresh burst"). A request run past its stop tokens (`ignore_eos`:
the serving bench's warm-up, a fixed-length benchmark's clients) keeps its drafted steps to itself: a warm-up's prompts
are unlike the load's (reversed, so that no load's prompt sits in a cache), and what a model writes after its end, no
request's text, repeats itself, so drafts land on it as on little else; from a warm-up on reversed prompts, the
requests of the load after it took a prior that locked them out of drafts that paid. Its drafts are the clock's: it
drafts the steps the clock wants timed whatever it yields, and its step's mix does not overrule it, so that a warm-up
times the drafted step the load is priced at (one drafting by its own low yield timed none at B = 8, and left that to
the load's first steps).

A drafted step's price is the plan's until the engine has timed both kinds of step (StepClock): then it is their
measured ratio at that batch size, or at the nearest one timed, scaled by the plan's prices at the two. The measure
carries what no profile does: the server's own work between steps, and the spell the machine is in (a VM's slow spells
slow a one-row step over a long context more than a drafted step's many rows). A batch size not yet timed has its first
steps drafted, then plain, until a few of each are timed, unless one within a factor of two of it (beyond B = 1) has
been (TIMED_NEAR_FACTOR) and it has not yet run many steps (SETTLED_STEPS: where the load settles, a borrowed price is
timed afresh); drafted ones only where the request's own yield comes within CANDIDATE_SPEEDUP of paying at the price
known so far (the nearest batch size timed, else the plan's): within that, the server's own work between steps, which no
profile times, can tip it (core/choices.py), and an "off" schedule entry keeps such a setting as its candidate to be
timed (core/plan_schema.py: Candidate); further below, timing a loss buys nothing the estimate does not say, and a batch
size reached as requests join (their prefill steps go untimed) would time it for many steps (docs/design.md). Where the
requests of a step answer differently, their mean settles its kind, or beside a probe the step's mix which of them join
it (settle_step), and a drafted step the clock wants is taken where their mean comes within CANDIDATE_SPEEDUP of paying:
held to paying, a batch whose requests straddle that band never timed one, and priced its drafts at the plan's price for
good.

A drafter that reads tokens before it can draft (a draft model's prompt, at its sequence's first drafted step; the
tokens of the steps it sat out) has that reading priced too, once the clock has timed one: a request starts or
resumes drafting only if drafting its remaining tokens saves more than the reading costs, and a probe's reading counts
against the probe's share; a probe that would read before any reading is timed waits (its cost unknown, it cannot be
held to the share, and the batch waits for every reading). A draft model catching up costs about as much per step sat
out as the probe share allows, so a request whose draft model stopped paying seldom probes. The reading is repaid only
by the drafted steps after it, so it is priced at the batch size the engine is likely to run at, the most sequences of
its recent steps (Scheduler: `load`), where that is above the step's: a closed loop's level begins with one request
alone for a step, the rest of its burst joining at the next, and that request read its draft model's prompt at B = 1
for a schedule off from B = 2, a 0.3-1.7 s prefill at every level start that cost a served C = 8 load 6-10% while it
drafted no step (docs/benchmark-log.md: "A lone first request's draft prompt").

Why a plain mean: a step's yield is skewed (most drafted steps emit one or two tokens, a few emit many), so an average
that weighs the last steps most sits below its mean most of the time and declines drafts that pay on average
(`bench/gate_replay.py` prices both on the plan's own prediction).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Collection
from typing import NamedTuple

from specplan.core.choices import CANDIDATE_SPEEDUP

# The drafted steps a request's yield is averaged over: few enough that a request whose text turns unpredictable stops
# drafting within a few steps (a reply of 64 tokens has 30-60 steps), enough that one unlucky step does not stop it
YIELD_WINDOW = 8
# Pseudo-steps at the plan's prediction in that mean: a request's first drafted step alone does not decide
PRIOR_STEPS = 2
# The share of a request's time sitting out that its probes may cost (a probe's step over a plain one, and its
# drafter's catching up): within the 3% a plan may cost against one-token decoding where its drafts never pay
PROBE_SHARE = 0.03
# The engine's steps a drafted step stays evidence for the requests joining an idle engine: where it locks a load unlike
# the last one out, for at most so many steps (eight replies of 128 tokens, one at a time); where the load's drafts
# keep missing, a request tries the plan's prediction again that seldom
RECENT_STEPS = 1024
# The steps of each kind (most sequences drafting, none) a batch size's measured price is the median of: recent enough
# to follow the machine's spells, enough to ride out a step that the OS or a prefill elsewhere slowed
MEASURED_STEPS = 16
# Steps of each kind timed before their ratio replaces the plan's price
MEASURED_AT_LEAST = 4
# The first steps of each kind at a batch size are not timed: a forward's first calls at new shapes are dear (a TriForce
# hierarchy's first drafted steps took 480-594 ms, later ones 248-272, on cpu-2c-zen3), and a price kept from them sat
# a TriForce load out of steps that paid; the serving bench's warm-up requests run them
UNTIMED_FIRST_STEPS = 4
# Nor are the first steps after a sequence joins the batch timed, whatever their kind: in a slow spell of a VM, the two
# after a join (its prefill's burst) ran 1.5-3x a step's time served, for every system and kind (`plan serve
# --step-log`), and a plan's plain steps, which its joiners' first decisions bring, fell on them: a drafted step's price
# at B = 4 slid from 1.56 to 0.79 plain steps and the plan drafted at a loss (docs/benchmark-log.md: "Steps after a
# join")
UNTIMED_AFTER_JOIN = 2
# A batch size beyond one within this factor of one whose steps of both kinds are timed takes its price from there
# (scaled by the plan's prices at the two) instead of timing its own: a served closed loop passes through every batch
# size up to C as requests join and leave, and timing each anew sat out a fifth of a TriForce load's steps at C = 8,
# while a drafted step's price in plain ones moves by 5-10% from B to 2B (t(B, n) profiles). B = 1 is timed apart:
# there one row runs a matrix-vector product, and the first rows beyond it cost the most.
TIMED_NEAR_FACTOR = 2
# Timed steps at a batch size after which it times its own price where it borrowed a near one's: the batch size a load
# settles at (C in a closed loop) runs hundreds of steps, and one borrowed there priced a TriForce hierarchy's drafted
# step at B = 4 from B = 2's 5.3 plain steps where B = 4's own measured 3.8-4.0, sitting a C = 4 load out of most of its
# steps; those passed through as requests join and leave run a few each
SETTLED_STEPS = 32
# Timed steps of the other kind at a batch size after which a kind's own timings there are stale and it is timed
# afresh: where a load drafts nearly every step, its plain steps come seldom, and the median of the last few, some from
# another spell of the machine, priced a served fp32 plan's drafted step at B = 3-8 at 0.86-1.14 plain steps (1.3-1.45
# timed in one process) and kept it drafting 65% of its steps at a loss (docs/benchmark-log.md: "Stale timings")
STALE_AFTER = 4 * MEASURED_STEPS

# (batch size, the request's context) -> (predicted tokens per step, speedup) or None
Pricing = Callable[[int, int], "tuple[float, float] | None"]
# (batch size, sequences drafting, the request's context) -> what they add to a plain step, as a share of what all add
# (BatchSchedule.mix_share), or None
MixShare = Callable[[int, int, int], "float | None"]
# Why a request drafted or sat a step out (DraftGate.reason), counted per request (GenerationResult.decisions):
# nothing priced there; the clock timing a kind of step; its drafts pay the price; they would, but not the reading its
# drafter does first; they do not; a probe; the step's mix overruling it (settle_step); its drafter not able to
# draft yet (`not_ready`)
REASONS = ("unpriced", "timing", "pays", "start not repaid", "sits out", "probe", "batch", "not ready")


class DraftPasses(NamedTuple):
    """A drafted step's draft forwards where their number follows the text (Drafter.draft_passes): their `passes`
    over the `sequences` that took any, in `seconds` of drafting (what the drafters read first not included)."""

    seconds: float
    passes: int
    sequences: int


class StepClock:
    """What the engine's decoding steps cost now, per batch size: the seconds from one step's start to the next's, of
    steps in which at least half the sequences drafted and of steps in which none did (steps that shared the machine
    with a prompt's prefill are not timed, nor the UNTIMED_AFTER_JOIN after a sequence joined, nor each kind's first
    UNTIMED_FIRST_STEPS at a batch size; those in which a drafter read tokens before drafting are timed less that
    reading, which it times apart; decoder/batching.py)."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[int, bool], deque[float]] = {}
        self.seen: dict[tuple[int, bool], int] = {}  # steps of each kind the engine finished, timed or not
        self.timed_steps: dict[int, int] = {}  # steps timed at each batch size, of either kind
        self.last_timed: dict[tuple[int, bool], int] = {}  # timed_steps at the batch size when each kind was last
        # the batch sizes whose plain steps are timed (MEASURED_AT_LEAST of them), and those whose drafted ones are too:
        # asked at every request's every decision, kept as they come rather than searched for
        self.timed_plain: set[int] = set()
        self.timed_both: set[int] = set()
        self.step = 0  # the steps begun: the requests sitting out probe together at multiples of their period
        self.start_rates: deque[float] = deque(maxlen=MEASURED_STEPS)  # a drafter's start: seconds per token read
        # per batch size, its timed drafted steps' DraftPasses as (seconds of one sequence's pass, passes a sequence)
        self.passes: dict[int, deque[tuple[float, float]]] = {}

    def begin_step(self) -> None:
        self.step += 1

    def step_done(self, batch: int, drafted: bool, seconds: float, passes: DraftPasses | None = None) -> bool:
        """A step of `batch` sequences the engine timed (a drafted one's `passes`, where its drafters' forwards follow
        the text): recorded unless among the first UNTIMED_FIRST_STEPS of its kind at that batch size; whether it
        was."""
        key = (batch, drafted)
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] <= UNTIMED_FIRST_STEPS:
            return False
        self.record(batch, drafted, seconds)
        if drafted and passes is not None and passes.passes > 0:
            self.passes.setdefault(batch, deque(maxlen=MEASURED_STEPS)).append(
                (passes.seconds / passes.passes, passes.passes / passes.sequences))
        return True

    def record(self, batch: int, drafted: bool, seconds: float) -> None:
        self.seconds.setdefault((batch, drafted), deque(maxlen=MEASURED_STEPS)).append(seconds)
        self.timed_steps[batch] = self.timed_steps.get(batch, 0) + 1
        self.last_timed[(batch, drafted)] = self.timed_steps[batch]
        if self._timed(batch, False):
            self.timed_plain.add(batch)
            if self._timed(batch, True):
                self.timed_both.add(batch)

    def _stale(self, batch: int, drafted: bool) -> bool:
        return self.timed_steps.get(batch, 0) - self.last_timed.get((batch, drafted), 0) > STALE_AFTER

    def _timed(self, batch: int, drafted: bool) -> bool:
        return len(self.seconds.get((batch, drafted), ())) >= MEASURED_AT_LEAST

    def wanted(self, batch: int, drafted_too: bool = True) -> bool | None:
        """The kind of step at `batch` sequences still to be timed (True: a drafted one), drafted first unless not
        `drafted_too`, or timed afresh once both are but its timings went stale (STALE_AFTER); None once those are, or
        where a batch size near it is (TIMED_NEAR_FACTOR) and it has not run SETTLED_STEPS timed steps. Every request
        in a step reads the same answer, so the step is of one kind."""
        near = self.nearest_timed(batch) if batch > 1 else None
        settled = self.seen.get((batch, True), 0) + self.seen.get((batch, False), 0) >= SETTLED_STEPS
        if (near is not None and near > 1 and max(near, batch) <= TIMED_NEAR_FACTOR * min(near, batch)
                and not settled):
            return None
        kinds = (True, False) if drafted_too else (False,)
        for drafted in kinds:
            if not self._timed(batch, drafted):
                return drafted
        if self._timed(batch, True):
            return next((drafted for drafted in kinds if self._stale(batch, drafted)), None)
        return None

    def nearest_timed(self, batch: int, drafted_too: bool = True) -> int | None:
        """The batch size nearest `batch` (the larger of two as near) with plain steps timed, and drafted ones if
        `drafted_too`; None before any."""
        return min(self.timed_both if drafted_too else self.timed_plain, key=lambda b: (abs(b - batch), -b),
                   default=None)

    def record_start(self, tokens: int, seconds: float) -> None:
        """A drafter's start: `tokens` read (a draft model's prompt) in `seconds`."""
        if tokens > 0:
            self.start_rates.append(seconds / tokens)

    def start_cost(self, batch: int, tokens: int) -> float | None:
        """A drafter reading `tokens` before it drafts, in plain steps at `batch` sequences (those of the nearest batch
        size timed); None before a start and plain steps are timed."""
        near = self.nearest_timed(batch, drafted_too=False)
        if not self.start_rates or near is None:
            return None
        return tokens * statistics.median(self.start_rates) / statistics.median(self.seconds[(near, False)])

    def pass_price(self, batch: int) -> tuple[float, float] | None:
        """At `batch` sequences, timed: the mean draft forwards a drafting sequence took in its timed drafted steps
        (DraftPasses), and one sequence's forward in plain steps there; None before both kinds and such steps are."""
        timed = self.passes.get(batch)
        if not timed or not self._timed(batch, False):
            return None
        return (statistics.fmean(passes for _, passes in timed),
                statistics.median(seconds for seconds, _ in timed) / statistics.median(self.seconds[(batch, False)]))

    def drafted_step_cost(self, batch: int) -> float | None:
        """A drafted step's price in plain steps at `batch` sequences, as measured; None before both kinds are."""
        if not (self._timed(batch, True) and self._timed(batch, False)):
            return None
        return statistics.median(self.seconds[(batch, True)]) / statistics.median(self.seconds[(batch, False)])


def shrunk_mean(prior: float, yields: Collection[float]) -> float:
    """The mean of `yields` beside PRIOR_STEPS pseudo-steps at `prior`."""
    return (PRIOR_STEPS * prior + sum(yields)) / (PRIOR_STEPS + len(yields))


class RecentYields:
    """The engine's last drafted steps' yields (tokens over the plan's prediction) and draft forwards (where they
    follow the text: Drafter.draft_passes), whichever requests drafted them, each with the engine's step it came at
    (`step`, counted by the engine): the priors of a request joining an idle engine, from those of the last
    RECENT_STEPS."""

    def __init__(self) -> None:
        self.yields: deque[tuple[int, float]] = deque(maxlen=YIELD_WINDOW)
        self.passes: deque[tuple[int, float]] = deque(maxlen=YIELD_WINDOW)
        self.step = 0

    def add(self, ratio: float) -> None:
        self.yields.append((self.step, ratio))

    def add_passes(self, passes: int) -> None:
        self.passes.append((self.step, passes))

    @property
    def prior(self) -> float:
        return shrunk_mean(1.0, self.yields_now())

    def yields_now(self) -> list[float]:
        """The yields of the recent drafted steps (within RECENT_STEPS)."""
        return self._recent(self.yields)

    @property
    def prior_passes(self) -> float | None:
        """The mean draft forwards of the recent drafted steps; None without any."""
        recent = self._recent(self.passes)
        return statistics.fmean(recent) if recent else None

    def _recent(self, kept: deque[tuple[int, float]]) -> list[float]:
        return [value for step, value in kept if self.step - step < RECENT_STEPS]


class DraftGate:
    """One request's decisions: `drafts(batch, context)` before a step, `observe(emitted, drafted)` after it."""

    def __init__(self, pricing: Pricing, clock: StepClock | None = None, shadowed: bool = False,
                 mix_share: MixShare | None = None) -> None:
        self.pricing = pricing
        self.mix_share = mix_share  # the plan's; None: a step costs a drafted one as soon as any request drafts
        self.clock = clock  # the engine's measured step costs; None: the plan's price alone
        self.shadowed = shadowed  # its drafter drafts in the shadow of the steps it sits out: it never probes
        self.yields: deque[float] = deque(maxlen=YIELD_WINDOW)  # its drafted steps' tokens over the prediction
        self.passes: deque[int] = deque(maxlen=YIELD_WINDOW)  # its drafted steps' draft forwards (Drafter.draft_passes)
        self.recent: RecentYields | None = None  # the engine's, which its drafted steps join (`join`)
        # the engine's recent drafted steps its priors follow until its own first counts (it joined an idle engine)
        self.follows: RecentYields | None = None
        self.of_load = True  # its text is the load's: not run past its stop tokens (`join`)
        self.idle_steps = 0
        # the weight of PRIOR_STEPS in r: the plan's prediction, its batch's mean r when it joined one, the engine's
        # recent drafted steps' when it joined an idle engine (`follows`); and the draft forwards it is priced at
        # before it has drafted (None: those of the steps the clock timed), the recent drafted steps' when it joined
        # an idle engine
        self.prior = 1.0
        self.prior_passes: float | None = None
        self.priced: tuple[float, float] | None = None  # the prediction of the step being decided
        self.batch = 1  # the sequences of the step being decided
        self.context = 0  # the request's tokens at it
        self.drafting = True
        # the last decision's grounds: what its drafted step should emit, at what price in plain steps; whether the
        # decision is firm (a step timing the clock, a probe, nothing priced); whether its drafter reads tokens first
        self.expected, self.step_cost, self.firm, self.reads_first = 0.0, 1.0, True, False
        self.reason = "unpriced"  # the last decision's, one of REASONS

    def join(self, recent: RecentYields, batch_yield: float | None, adds_to_recent: bool = True) -> None:
        """The request joins an engine whose recent drafted steps are `recent`, which its own join unless not
        `adds_to_recent` (a request run past its stop tokens: its text is no evidence of the load's), and whose batch
        in flight has the mean r `batch_yield`: its prior; or, where that is None (the engine idle, or its batch
        without a drafted step yet), the engine's recent drafted steps as they stand at each of its decisions until its
        own first counts."""
        self.recent = recent if adds_to_recent else None
        self.of_load = adds_to_recent
        if batch_yield is not None:
            self.prior = batch_yield
        else:
            self.follows = recent

    @property
    def uninformed(self) -> bool:
        """Whether it decided its coming step on the plan's prediction alone, its text the load's: no drafted step of
        its own, its batch's or the engine's recent ones to go by (a burst joining a fresh engine)."""
        return (self.of_load and self.priced is not None and self.follows is not None
                and not self.follows.yields_now())

    @property
    def yield_ratio(self) -> float:
        """r: the request's tokens per drafted step over the plan's prediction (its prior before its first)."""
        return shrunk_mean(self.prior, self.yields)

    def drafts(self, batch: int, context: int, start_tokens: int = 0, remaining: int | None = None,
               load: int | None = None) -> bool:
        """Whether the request (`context` tokens so far, `remaining` still to emit) drafts at the coming step of
        `batch` sequences; its drafter reads `start_tokens` first if it does (a draft model's prompt not read yet,
        the tokens of the steps it sat out), which is priced at `load` sequences where that is more (the engine's
        recent most)."""
        self.priced, self.batch, self.context = self.pricing(batch, context), batch, context
        self.firm, self.reads_first = True, start_tokens > 0
        if self.follows is not None:
            self.prior, self.prior_passes = self.follows.prior, self.follows.prior_passes
        if self.priced is None:  # nothing priced (or the schedule off there): the drafter's setting decides
            self.drafting, self.reason = True, "unpriced"
            return True
        tokens, speedup = self.priced
        step_cost = self._step_cost(batch, context, tokens / speedup)
        start = self._start_cost(batch, start_tokens)
        expected = self.yield_ratio * tokens  # what its next drafted step should emit
        start_repaid = self._start_repaid(batch, context, start_tokens, remaining, load, (start, step_cost, expected))
        # a drafted step times the clock only where this request's own yield comes near paying at the price known, or
        # where its text is no evidence of the load's (a warm-up's: it times the price the load decides at)
        near_paying = expected >= CANDIDATE_SPEEDUP * step_cost or not self.of_load
        wanted = self.clock.wanted(batch, drafted_too=near_paying) if self.clock is not None else None
        self.expected, self.step_cost = expected, step_cost
        if wanted is not None and (start_repaid or not wanted):  # the few steps that time each kind
            # where the batch's answers differ, its mean settles the step's kind; a drafted one timed past the stop
            # tokens stands
            drafting, self.firm = wanted, wanted and not self.of_load
            self.reason = "timing"
        elif expected >= step_cost:
            drafting, self.firm = start_repaid, False
            self.reason = "pays" if start_repaid else "start not repaid"
        else:
            alone = self.mix_cost(batch, 1, step_cost) if batch > 1 else None  # where priced, a probe drafting alone
            loss = step_cost - expected if alone is None else batch * alone - (expected - 1.0)
            drafting = not self.shadowed and self._probe_due(batch, loss, start)
            self.firm = drafting  # a probe
            self.reason = "probe" if drafting else "sits out"
        self.overrule(drafting)
        return drafting

    def overrule(self, drafting: bool) -> None:
        """The coming step's decision, as the batch's step takes it (settle_step)."""
        self.drafting = drafting
        self.idle_steps = 0 if drafting else self.idle_steps + 1

    def not_ready(self) -> None:
        """Its drafter cannot draft at the coming step it decided to draft (a TriForce sequence's first step, whose
        forward gives the query of its first build): a plain step, not a drafted one without a draft (`observe`), which
        its step's mix does not overrule (settle_step)."""
        self.overrule(False)
        self.firm, self.reason = True, "not ready"

    def _step_cost(self, batch: int, context: int, planned: float) -> float:
        """A drafted step's price in plain steps at `batch` sequences (the plan's: `planned`), on the clock where it
        has timed one: measured there, else at the nearest batch size timed, scaled by the plan's prices at the two;
        and its own draft forwards beyond those of the steps timed there, where their number follows the text."""
        near = self.clock.nearest_timed(batch) if self.clock is not None else None
        if near is None:
            return planned
        measured = self.clock.drafted_step_cost(near)
        there = self.pricing(near, context) if near != batch else None
        return (measured * planned / (there[0] / there[1]) if there is not None else measured) + self._own_passes(near)

    def _own_passes(self, near: int) -> float:
        """What its recent drafted steps' draft forwards cost beyond the mean of the steps the clock timed at `near`,
        in plain steps there (fewer: a saving), each a sequence's share of a pass; before its first, those of its
        prior (an idle engine's recent drafted steps). A TriForce chain whose bottom misses takes up to gamma2 middle
        rounds where the steps the clock timed took a few (a warm-up past its end, the load's own text), and its
        drafted steps cost it nearly twice their median (docs/benchmark-log.md: "A drafted step's own forwards").
        0 where no pass is timed there, or nothing is known of its own."""
        own = statistics.fmean(self.passes) if self.passes else self.prior_passes
        price = self.clock.pass_price(near) if own is not None else None
        if price is None:
            return 0.0
        timed_passes, pass_cost = price
        return (own - timed_passes) * pass_cost

    def mix_cost(self, batch: int, drafting: int, step_cost: float) -> float | None:
        """What `drafting` of a step's `batch` sequences drafting add to its plain step, in plain steps at `batch` (the
        whole batch's time), where all of them drafting add `step_cost` - 1: that times the plan's share for the step's
        mix (BatchSchedule.mix_share: its rows in t(B, n), the draft's forwards over the drafting sequences alone);
        None where the plan priced no such step."""
        share = self.mix_share(batch, drafting, self.context) if self.mix_share is not None else None
        return None if share is None else (step_cost - 1.0) * share

    def _start_repaid(self, batch: int, context: int, start_tokens: int, remaining: int | None, load: int | None,
                      here: tuple[float | None, float, float]) -> bool:
        """Whether drafting the `remaining` tokens saves more plain steps, remaining x (1 - step cost / expected),
        than the drafter's reading of `start_tokens` costs (a reading not priced yet: it does, and times one); at the
        coming step's `batch` (`here`: the reading's cost, the drafted step's and its expected tokens, in plain steps
        there) or, where the engine's recent `load` is more, at that batch size (none where nothing drafts there)."""
        start, step_cost, expected = here
        if load is not None and load > batch and start_tokens:
            priced = self.pricing(load, context)
            if priced is None:
                return False
            tokens, speedup = priced
            start, step_cost = self._start_cost(load, start_tokens), self._step_cost(load, context, tokens / speedup)
            expected = self.yield_ratio * tokens
        return not start or remaining is None or remaining * (1.0 - step_cost / expected) > start

    def _start_cost(self, batch: int, start_tokens: int) -> float | None:
        """The drafter's reading before it drafts, in plain steps at `batch` sequences: 0 with nothing to read (or no
        clock); None while the clock has not priced a reading (a request whose drafts pay starts anyway, and times
        one; a probe waits)."""
        if not start_tokens or self.clock is None:
            return 0.0
        return self.clock.start_cost(batch, start_tokens)

    def _probe_due(self, batch: int, loss: float, start: float | None) -> bool:
        """Whether a request sitting steps out drafts at the coming one: once its probe (the plain steps a drafted step
        loses at its expected yield, `loss`: where the plan prices a lone drafter's step (`mix_cost`), the batch's
        steps that costs less the tokens it gains, else its own at the drafted price, as where the whole batch probes
        together; and its own reading, `start`, which the batch waits for) costs at most
        PROBE_SHARE of the time it sat out; with a clock, at the steps numbered a multiple of the period that share
        gives a probe, rounded up to a power of two (requests at different yields probe together at the longer one's
        steps). A reading not priced yet (None) cannot be held to that share: no probe."""
        if start is None or (self.idle_steps + 1) * PROBE_SHARE < loss + batch * start:
            return False
        return self.clock is None or self.clock.step % probe_period(loss) == 0

    def observe(self, emitted: int, drafted: int, passes: int | None = None) -> None:
        """The step just verified scored `drafted` draft tokens, drafted in `passes` forwards where their number
        follows the text (Drafter.draft_passes), and emitted `emitted` (the accepted drafts and the target's next
        token). A drafting request whose drafter had nothing to propose (a trie without a match) counts beside other
        sequences, as the one token it emitted: its batch's step was a drafted one, priced as such."""
        if self.drafting and drafted > 0 and passes is not None:
            self.passes.append(passes)
            if self.recent is not None:
                self.recent.add_passes(passes)
        if self.drafting and self.priced is not None and self._counts(drafted > 0):
            self._add_yield(emitted / self.priced[0])

    def observe_shadow(self, emitted: int, matched: bool = True) -> None:
        """A step the request sat out would have emitted `emitted` tokens had it drafted (Drafter.shadow_yields);
        without a `matched` draft, it counts as `observe` counts such a drafted step: beside other sequences only."""
        if self.priced is not None and self._counts(matched):
            self._add_yield(emitted / self.priced[0])

    def observe_shadow_passes(self, passes: list[int]) -> None:
        """Steps the request sat out would have taken `passes` draft forwards each had they drafted
        (Drafter.shadow_passes): they join its own drafted steps' in the mean its drafted step's price follows
        (`_own_passes`), so that a request sitting out sees that price move with its text where a probe comes seldom."""
        self.passes.extend(passes)

    def _counts(self, matched: bool) -> bool:
        """Whether a step (drafted or in the shadow) counts: one without a match only beside other sequences, where it
        rode the batch's drafted step; alone it cost a plain one."""
        return matched or self.batch > 1

    def _add_yield(self, ratio: float) -> None:
        self.follows = None  # its priors stay those its first counted step was decided at
        self.yields.append(ratio)
        if self.recent is not None:
            self.recent.add(ratio)


def probe_period(loss: float) -> int:
    """The steps between the probes of requests sitting out whose probe loses `loss` plain steps: the power of two at
    or above the steps whose PROBE_SHARE pays that loss."""
    return 1 << max(0, math.ceil(math.log2(max(loss, PROBE_SHARE) / PROBE_SHARE)))


def settle_step(gates: list[DraftGate]) -> None:
    """Which requests of one step (their gates just decided) draft, where their decisions differ. Where none is firm,
    every request drafts if their mean expected yield pays the drafted step's price (those whose drafters need not
    read first), else none: a step's cost grows with the rows it scores and the draft forwards it runs, and these
    cost most where they are fewest (on a CPU the one-row matmul gives way to tiles; a lone TriForce chain's middle
    rounds beside seven plain sequences added 1.2-1.4 plain steps of B = 8 to the batch's step, where all eight chains
    added 5.4), and choosing the requests expecting most instead picks those whose estimates ran highest by chance: a
    served C = 8 load settled so drafted its top 7 of 8 at a loss, 0.90 of one-token decoding where the batch's mean
    held it to 0.97 (docs/benchmark-log.md: "A step's mix"). Where one of them drafts to time the clock, the mean need
    only come within CANDIDATE_SPEEDUP of the price, the band a request times a drafted step in. Where some decisions
    are firm (a probe, nothing priced), those stand, and the others join them where they gain more tokens than they
    add to the step, priced by its mix where the plan priced it (DraftGate.mix_cost: what k of B drafting add), the
    ones expecting most first; else the others stand too. Before all that, of the requests that would draft with
    nothing but the plan's prediction to go by (DraftGate.uninformed), the first alone does: its yield is the others'
    prior at the next step, where each drafting at the plan's r paid a drafted step to learn it (a lone TriForce chain
    beside seven plain sequences costs the step a fifth of what eight chains do)."""
    for gate in [gate for gate in gates if gate.drafting and gate.uninformed][1:]:
        gate.overrule(False)
        gate.firm, gate.reason = True, "batch"
    if len({gate.drafting for gate in gates}) < 2 or all(gate.firm for gate in gates):
        return
    batch = len(gates)
    drafted = statistics.fmean(gate.step_cost for gate in gates)  # a drafted step's price, all of them drafting
    able = [gate for gate in gates if not gate.firm and (gate.drafting or not gate.reads_first)]
    # drafting: a probe, a request whose drafts nothing prices, one timing the clock past its stop tokens
    fixed = sum(gate.firm and gate.drafting for gate in gates)
    timing = any(gate.drafting and gate.reason == "timing" for gate in gates)
    if not fixed:
        share = CANDIDATE_SPEEDUP if timing else 1.0
        chosen = able if statistics.fmean(gate.expected for gate in gates) >= share * drafted else []
    else:
        mix = [gates[0].mix_cost(batch, drafting, drafted) for drafting in range(fixed, batch)] + [drafted - 1.0]
        if timing or None in mix:
            return
        able.sort(key=lambda gate: gate.expected, reverse=True)
        gains = itertools.accumulate((gate.expected - 1.0 for gate in able), initial=0.0)
        net = [gain - batch * mix[count] for count, gain in enumerate(gains)]
        chosen = able[:net.index(max(net))]
    for gate in gates:
        if gate.firm:
            continue
        drafting = any(gate is other for other in chosen)
        if drafting != gate.drafting:
            gate.reason = "batch"
        gate.overrule(drafting)
