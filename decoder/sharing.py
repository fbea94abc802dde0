"""A step's rows shared among its requests by what their own drafts are expected to yield (a Lookahead plan solved
with `--share-rows`; core/plan_schema.py: RowSharing), instead of one decoding length for the whole batch.

Each step, every request's trie retrieves the longest draft the plan's sharing trie allows (TrieDrafter.survey: a
retrieval adds its nodes in one order whatever its length, so its first n nodes are its draft of n nodes), and the
text that follows tells what each cut of it would have emitted (ShadowDraft.emitted_within), scored or not. A
request's expected tokens at each decoding length are the engine's mean over the surveys that followed one like its
last (what its last settled survey emitted: 1, 2, 3, or AFTER_BUCKETS or more tokens), beside PRIOR_STEPS pseudo-steps
at the plan's replay of that length: Lookahead's drafts land in runs (a request copying its prompt, a list, a
boilerplate phrase), so a request's last step says more of its next than its average does (bench/budget_replay.py
priced both: each request's own mean lost to the static schedule, this won at every concurrency).

The rows are then handed out one request's next decoding length at a time, the most expected tokens per extra row
first, and the step keeps the allocation whose expected tokens per second peak on the plan's step prices (at the
step's total of rows: RowSharing.seconds): requests whose drafts land get long drafts, those whose drafts miss get
none, and none drafts where no allocation is expected to beat plain steps by the plan's margin (`min_speedup`, the
schedule's: a served step spreads by several percent around its price). Each sequence's tree is verified alone, so
greedy output and the sampled distribution are the target's whatever rows it was given.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque

from specplan.core.plan_schema import RowSharing
from specplan.decoder.drafters import ShadowDraft, TrieDrafter
from specplan.decoder.gate import MEASURED_AT_LEAST, MEASURED_STEPS, PRIOR_STEPS

# A request's last settled survey emitted 1, 2, 3, ... or at least this many tokens: the classes of steps the engine
# keeps its yields after (beyond three drafted tokens, runs are alike)
AFTER_BUCKETS = 4
# The drafted request-steps whose tokens beyond the root, against what the allocation expected of them, scale the
# next expectations: enough for the engine's mix of requests, recent enough to follow it
YIELD_CHECKS = 64
# Tokens beyond the root, at the expected count, beside those drafted steps: a few steps' worth
YIELD_CHECK_PRIOR = 8.0


class SharedRows:
    """The engine's yields after each class of step, and each step's allocation (`decide`)."""

    def __init__(self, table: RowSharing) -> None:
        self.table = table
        self.lengths = table.lengths  # 1 (no draft) first
        self.prior = [table.tokens_per_step[length] for length in self.lengths]
        self.sums = [[0.0] * len(self.lengths) for _ in range(AFTER_BUCKETS)]
        self.counts = [0] * AFTER_BUCKETS
        # the served truth the table is held to: drafted request-steps' (expected, emitted) tokens beyond the root,
        # and each step's measured seconds over its price, of plain steps and of steps with drafts
        self.checks: deque[tuple[float, float]] = deque(maxlen=YIELD_CHECKS)
        self.step_ratios: dict[bool, deque[float]] = {kind: deque(maxlen=MEASURED_STEPS) for kind in (False, True)}
        self.priced: tuple[float, bool] | None = None  # the step in flight: its price, whether any sequence drafts
        self.given: dict[int, float] = {}  # id(drafter) -> the tokens its drafted step in flight is expected to emit

    @property
    def yield_scale(self) -> float:
        """The tokens beyond the root that drafted steps emitted over those expected of them (1 before any)."""
        return ((YIELD_CHECK_PRIOR + sum(emitted for _, emitted in self.checks))
                / (YIELD_CHECK_PRIOR + sum(expected for expected, _ in self.checks)))

    @property
    def cost_scale(self) -> float:
        """A step with drafts over its price, against a plain step over its price, as measured (1 before a few of
        each are timed): the profile prices the engine alone, in the spell it was taken in."""
        plain, drafted = self.step_ratios[False], self.step_ratios[True]
        if min(len(plain), len(drafted)) < MEASURED_AT_LEAST:
            return 1.0
        return statistics.median(drafted) / statistics.median(plain)

    def expected(self, after: int | None) -> list[float]:
        """Tokens a step would emit at each of `lengths`, after a survey that emitted `after` (None: the request's
        first, the plan's replay)."""
        if after is None:
            return list(self.prior)
        bucket = min(after, AFTER_BUCKETS) - 1
        count = self.counts[bucket]
        return [(PRIOR_STEPS * prior + total) / (PRIOR_STEPS + count)
                for prior, total in zip(self.prior, self.sums[bucket])]

    def observe(self, shadow: ShadowDraft) -> None:
        """A survey the text has settled: what each cut of it emitted, after the survey before it."""
        if shadow.after is None:
            return
        bucket = min(shadow.after, AFTER_BUCKETS) - 1
        self.counts[bucket] += 1
        for i, length in enumerate(self.lengths):
            self.sums[bucket][i] += shadow.emitted_within(length)

    def allocate(self, expected: list[list[float]], sizes: list[int]) -> list[int]:
        """Each sequence's rows (1: its root alone), from `expected` (per sequence, its tokens at each of `lengths`)
        and `sizes` (its longest draft's nodes): one sequence's next length at a time, the most expected tokens per
        extra row first, keeping the allocation whose expected tokens per second over the batch peak, if that beats
        plain steps by the plan's margin. Runs every step for every sequence: the sums are kept as it goes and the
        next upgrade comes off a heap."""
        batch = len(expected)
        # per sequence: its choices as (rows, expected tokens), rows increasing (lengths beyond its draft's size
        # score that draft whole)
        choices = []
        for tokens, size in zip(expected, sizes):
            options: list[tuple[int, float]] = []
            for length, value in zip(self.lengths, tokens):
                rows = min(length, size)
                if not options or rows > options[-1][0]:
                    options.append((rows, value))
            choices.append(options)
        cost_scale = self.cost_scale
        rows, tokens = batch, sum(options[0][1] for options in choices)
        plain_rate = best_rate = tokens / self.table.seconds(batch, batch)
        chosen, best = [0] * batch, [0] * batch
        # upgrades as (-expected tokens per extra row, sequence); a sequence's next enters once it takes this one
        heap = [(-(o[1][1] - o[0][1]) / (o[1][0] - o[0][0]), i) for i, o in enumerate(choices) if len(o) > 1]
        heapq.heapify(heap)
        while heap and heap[0][0] < 0:
            _, i = heapq.heappop(heap)
            options, c = choices[i], chosen[i]
            rows += options[c + 1][0] - options[c][0]
            tokens += options[c + 1][1] - options[c][1]
            chosen[i] = c + 1
            if c + 2 < len(options):
                step_up = options[c + 2]
                heapq.heappush(heap, (-(step_up[1] - options[c + 1][1]) / (step_up[0] - options[c + 1][0]), i))
            rate = tokens / (self.table.seconds(batch, rows) * cost_scale)
            if rate > best_rate:
                best, best_rate = list(chosen), rate
        if best_rate < self.table.min_speedup * plain_rate:  # within the margin a served step's price has
            return [1] * batch
        return [choices[i][c][0] for i, c in enumerate(best)]

    def decide(self, drafters: list[TrieDrafter], roots: list[int]) -> list[int]:
        """The coming step's rows for each sequence in flight (its drafter, its root): each surveys its longest
        draft, then drafts the rows it is given, which are returned. The tokens expected beyond the root are scaled by
        what drafted steps have emitted against their expectation (`yield_scale`), a step with drafts priced by what
        such steps have cost against plain ones (`cost_scale`)."""
        sizes = [drafter.survey(root) for drafter, root in zip(drafters, roots)]
        scale = self.yield_scale
        expected = [[1.0 + scale * (tokens - 1.0) for tokens in self.expected(drafter.last_emitted)]
                    for drafter in drafters]
        rows = self.allocate(expected, sizes)
        self.given = {}
        for drafter, given, tokens, size in zip(drafters, rows, expected, sizes):
            drafter.draft_nodes(given)
            drafter.drafting = given > 1
            if given > 1:  # the expectation of the length it was given (its draft's whole, beyond its size)
                self.given[id(drafter)] = next(value for length, value in zip(self.lengths, tokens)
                                               if min(length, size) == given)
        self.priced = (self.table.seconds(len(rows), sum(rows)), max(rows) > 1)
        return rows

    def emitted(self, drafter: TrieDrafter, tokens: int) -> None:
        """The step in flight emitted `tokens` for `drafter`'s sequence."""
        expected = self.given.pop(id(drafter), None)
        if expected is not None:
            self.checks.append((expected - 1.0, tokens - 1.0))

    def timed(self, seconds: float) -> None:
        """The step in flight took `seconds` (from its start to the next step's, no prefill between)."""
        if self.priced is not None:
            price, drafted = self.priced
            self.step_ratios[drafted].append(seconds / price)
            self.priced = None
