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
first, and the step keeps the allocation whose expected tokens per second peak on the plan's step prices (t(B, n) at
the mean rows per sequence): requests whose drafts land get long drafts, those whose drafts miss get none, and none
drafts where no allocation is expected to beat plain steps by the plan's margin (`min_speedup`, the schedule's: a
served step spreads by several percent around its price). Each sequence's tree is verified alone, so greedy output
and the sampled distribution are the target's whatever rows it was given.
"""

from __future__ import annotations

from specplan.core.plan_schema import RowSharing
from specplan.decoder.drafters import ShadowDraft, TrieDrafter
from specplan.decoder.gate import PRIOR_STEPS

# A request's last settled survey emitted 1, 2, 3, ... or at least this many tokens: the classes of steps the engine
# keeps its yields after (beyond three drafted tokens, runs are alike)
AFTER_BUCKETS = 4


class SharedRows:
    """The engine's yields after each class of step, and each step's allocation (`decide`)."""

    def __init__(self, table: RowSharing) -> None:
        self.table = table
        self.lengths = table.lengths  # 1 (no draft) first
        self.prior = [table.tokens_per_step[length] for length in self.lengths]
        self.sums = [[0.0] * len(self.lengths) for _ in range(AFTER_BUCKETS)]
        self.counts = [0] * AFTER_BUCKETS

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
        plain steps by the plan's margin."""
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
        chosen = [0] * batch  # index into each sequence's choices

        def rate() -> float:
            rows = sum(choices[i][c][0] for i, c in enumerate(chosen))
            return sum(choices[i][c][1] for i, c in enumerate(chosen)) / self.table.seconds(batch, rows / batch)

        plain_rate = rate()
        best, best_rate = list(chosen), plain_rate
        while True:
            upgrades = [((options[c + 1][1] - options[c][1]) / (options[c + 1][0] - options[c][0]), -i)
                        for i, (options, c) in enumerate(zip(choices, chosen)) if c + 1 < len(options)]
            if not upgrades or max(upgrades)[0] <= 0:
                break
            chosen[-max(upgrades)[1]] += 1
            now = rate()
            if now > best_rate:
                best, best_rate = list(chosen), now
        if best_rate < self.table.min_speedup * plain_rate:  # within the margin a served step's price has
            return [1] * batch
        return [choices[i][c][0] for i, c in enumerate(best)]

    def decide(self, drafters: list[TrieDrafter], roots: list[int]) -> list[int]:
        """The coming step's rows for each sequence in flight (its drafter, its root): each surveys its longest
        draft, then drafts the rows it is given, which are returned."""
        sizes = [drafter.survey(root) for drafter, root in zip(drafters, roots)]
        rows = self.allocate([self.expected(drafter.last_emitted) for drafter in drafters], sizes)
        for drafter, given in zip(drafters, rows):
            drafter.draft_nodes(given)
            drafter.drafting = given > 1
        return rows
