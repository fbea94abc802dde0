"""Plan files (`kind: plan/<method>`): the contract between the planner, which writes them, and the decoder.

Every plan names the models it was made for (`models`: target, draft, dtype, draft_dtype and, when the draft
scores only part of the vocabulary, `draft_vocab`: the ids below it, plus the stop tokens), records its inputs
(`inputs`), its prediction (`prediction.tokens_per_step`, `prediction.speedup` when a latency profile was
given), how it was solved (`solver`) and where it came from (`provenance`: its inputs' hashes and, from `plan solve`,
the command that solved it). Method-specific fields:

- plan/sequoia: `tree: {size, depth, parents}`: node 0 is the root (the last accepted token) with parent
  -1; nodes are in BFS order and the children of a node appear in rank order (rank 1 first).
- plan/lookahead: `lookahead: {decoding_length, branch_length, window, max_prefix, capacity, prompt_weight}`
  (the trie settings, decoder/trie.py) and `tokenizer: {vocab_size, sha256}` (a trie plan holds token ids).
- plan/triforce: `triforce: {gamma1, gamma2, budget, chunk, stride, context, rebuild_below, bottom, sinks,
  window}`: bottom is `trie` (a Lookahead trie with default settings) or `model` (models.draft with a
  StreamingLLM cache of `sinks` + `window` tokens), `none` (the two-level variant), or `streaming` (no middle
  level: models.draft, else the target itself, over a StreamingLLM cache drafts `gamma2` tokens straight for the
  target over its full cache; budget, chunk and stride are then the best two-level setting's). `speculate: false`
  (written when no setting is predicted fast enough) decodes one token per step; the other settings are then
  the best speculative setting's, which `plan bench` runs its TriForce baselines with.

A plan solved with `--batches` also carries `schedule: {context, entries: [{batches: [low, high], speculate,
decoding_length, tokens_per_step, tokens_per_second, speedup, speedups}, ...], mix_shares}`: for each range of batch
sizes (the sequences a step decodes together, ranges contiguous from 1), the setting predicted to give the most output
tokens per second over the whole batch at `context`, and that prediction at the range's first size (speedup: over no
speculation at the same batch size; `speedups`: the drafted setting's, or an off entry's candidate's, at each size of
the range, absent in plans solved before them). `mix_shares`: at each batch size B from 1, what k of the B sequences
drafting the setting priced there (an off entry's candidate) add to a plain step, as a share of what all B add, at k =
1, 2, 4, ... below B (`mix_points`; linear between them): the profile's t(B, n) of the step's rows and the draft's
forwards over the k alone (planner/closed_loop.py: step_seconds), by which the decoder prices a step where some of its
requests draft (decoder/gate.py: settle_step); empty where nothing drafts at B, absent in plans solved before them. The
decoder picks the entry of the sequences in flight at each step; beyond the last range, the last entry. Solved with
`--contexts` too, the schedule holds one such table per context: the first with `up_to_context` (the longest sequence it
covers), then `longer: [{context, up_to_context, entries}, ..., {context, entries}]`, each sequence following the table
of its own current length. Lookahead's entries vary the decoding length under the plan's own trie (`speculate: false`:
the root alone, the trie still learning); a draft-model chain's (a Sequoia plan whose tree is a chain, solved for a
chain engine) vary the draft length, `decoding_length` - 1 tokens, at most the plan's chain; a TriForce hierarchy's vary
its chain's length, gamma2 = `decoding_length` - 1 (the middle level's rounds collect at least that many tokens), at
most the plan's gamma2, its bottom, gamma1 and retrieval cache kept; an engine's n-gram chain (a prompt-lookup plan for
llama-server) varies its tokens drafted, `decoding_length` - 1, at most the plan's num_tokens, its n-gram kept. An entry
that does not speculate may keep a `candidate: {decoding_length, tokens_per_step, speedup}`, its best drafting setting
where that is predicted within the margin (CANDIDATE_SPEEDUP up to MIN_SPEEDUP, core/choices.py): requests that decide
step by step whether to draft (decoder/gate.py) draft it only once the steps' measured prices say it pays; engines'
tables and fixed settings read the entry as off. A plan without a schedule is the batch-1 plan at every batch size.

A Lookahead plan solved with `--share-rows` also carries `sharing: {trie, context, tokens_per_step: {length: tokens},
step_seconds: {batch size: [seconds at 1, 2, ... rows per sequence]}, min_speedup}` (RowSharing): instead of one
decoding length for the whole batch, each step's rows go to the requests whose drafts are expected to land
(decoder/sharing.py), priced on that table.
"""

from __future__ import annotations

import numbers
import os
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from specplan.core.choices import ENGINES, LOOKUP_ENGINES, PROFILE_DTYPES, TIMED_FORWARDS
from specplan.core.errors import UserError
from specplan.core.fileio import check_plain_values, plain, read_yaml, write_yaml
from specplan.core.method_settings import NgramTreeSettings, PromptLookupSettings, TrieSettings, TriForceSettings
from specplan.core.model_names import same_model
from specplan.core.validate import FORMAT_VERSION, MAX_SECONDS, MAX_VOCABULARY, Fields, check_number, token_count_key

PLAN_KINDS = ("plan/sequoia", "plan/lookahead", "plan/triforce", "plan/prompt-lookup")
MAX_TREE_NODES = 1 << 16  # far above any tree a target verifies in one forward


@dataclass(frozen=True)
class TokenTree:
    """A rooted ordered tree given by BFS-ordered parents; children of a node are in rank order."""

    parents: tuple[int, ...]

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.parents) - 1))

    @classmethod
    def from_parents(cls, parents: Any, where: str = "tree") -> TokenTree:
        values = list(parents) if isinstance(parents, (list, tuple, np.ndarray)) else None
        if values is not None and len(values) > MAX_TREE_NODES:
            raise UserError(f"{where}: {len(values)} nodes; a tree holds at most {MAX_TREE_NODES}")
        if values is None or not all(isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in values):
            raise UserError(f"{where}: parents must be a list of integers")
        tree = cls(tuple(int(p) for p in values))
        tree._check(where)
        return tree

    def _check(self, where: str) -> None:
        """Parents must precede children and be non-decreasing: that is BFS order with siblings contiguous."""
        parents = self.parents
        if not parents or parents[0] != -1:
            raise UserError(f"{where}: node 0 must be the root with parent -1")
        for v in range(1, len(parents)):
            if not 0 <= parents[v] < v:
                raise UserError(f"{where}: node {v} has parent {parents[v]}; parents must precede their children")
            if parents[v] < parents[v - 1]:
                raise UserError(f"{where}: node {v} breaks BFS order (parent {parents[v]} after {parents[v - 1]})")

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> list[int]:
        depths = [0] * len(self.parents)
        for v in range(1, len(self.parents)):
            depths[v] = depths[self.parents[v]] + 1
        return depths

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def children(self) -> list[list[int]]:
        children: list[list[int]] = [[] for _ in self.parents]
        for v in range(1, len(self.parents)):
            children[self.parents[v]].append(v)
        return children

    @property
    def ranks(self) -> list[int]:
        """Rank of each node among its siblings, starting at 0 (the root gets 0)."""
        ranks = [0] * len(self.parents)
        for kids in self.children:
            for rank, child in enumerate(kids):
                ranks[child] = rank
        return ranks

    def paths(self) -> list[tuple[int, ...]]:
        """Per non-root node (BFS order), the sibling ranks (0-based) on its root path: Medusa/EAGLE choices."""
        paths: list[tuple[int, ...]] = [()]
        ranks = self.ranks
        for v in range(1, len(self.parents)):
            paths.append(paths[self.parents[v]] + (ranks[v],))
        return paths[1:]

    @classmethod
    def from_paths(cls, paths: list[Any], where: str = "choices") -> TokenTree:
        """Inverse of `paths`: the tree whose non-root nodes have these rank paths (in any order)."""
        try:
            keys = sorted({tuple(int(r) for r in path) for path in paths}, key=lambda t: (len(t), t))
        except (TypeError, ValueError):
            raise UserError(f"{where}: each choice must be a list of integers") from None
        if len(keys) != len(paths):
            raise UserError(f"{where}: duplicate paths")
        index = {(): 0}
        by_parent: dict[tuple[int, ...], list[int]] = {}
        for key in keys:
            if not key or any(r < 0 for r in key):
                raise UserError(f"{where}: paths must be non-empty lists of ranks >= 0")
            if key[:-1] not in index and key[:-1] != ():
                raise UserError(f"{where}: path {list(key)} has no parent path {list(key[:-1])}")
            by_parent.setdefault(key[:-1], []).append(key[-1])
            index[key] = -1
        for parent, ranks in by_parent.items():
            if sorted(ranks) != list(range(len(ranks))):
                raise UserError(f"{where}: children of {list(parent)} must have ranks 0..{len(ranks) - 1}")
        # BFS from the root, children in rank order.
        parents = [-1]
        order: deque[tuple[int, ...]] = deque([()])
        while order:
            node = order.popleft()
            for rank in range(len(by_parent.get(node, []))):
                child = node + (rank,)
                parents.append(index[node])
                index[child] = len(parents) - 1
                order.append(child)
        return cls.from_parents(parents, where)


def _finite_mapping(data: Any, where: str) -> dict[str, Any]:
    """A free-form section (inputs, solver, provenance, ...): a mapping of plain, finite values."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping")
    check_plain_values(data, where)
    return data


@dataclass(frozen=True)
class PlanModels:
    """The models a plan was made for; `draft_vocab`: the draft scores only the token ids below it; `backend`: the
    forward its profile timed (the prediction holds for it)."""

    target: str | None = None
    draft: str | None = None
    dtype: str | None = None
    draft_dtype: str | None = None
    draft_vocab: int | None = None
    backend: str | None = None

    @classmethod
    def from_fields(cls, f: Fields | None) -> PlanModels:
        if f is None:
            return cls()
        return cls(target=f.string("target", required=False), draft=f.string("draft", required=False),
                   dtype=f.string("dtype", required=False, choices=PROFILE_DTYPES),
                   draft_dtype=f.string("draft_dtype", required=False, choices=PROFILE_DTYPES),
                   draft_vocab=f.integer("draft_vocab", required=False, low=1, high=MAX_VOCABULARY),
                   backend=f.string("backend", required=False, choices=TIMED_FORWARDS))

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Prediction:
    """What the solver predicts for the plan on the profiled machine. The figures every method gives are fields;
    `details` holds a method's own (TriForce's baselines at their best settings, which `plan bench` runs; the
    replayed token count of Lookahead), written beside them in the same mapping."""

    tokens_per_step: float
    speedup: float | None = None  # over one-token decoding; None without a profile
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    seconds_per_token: float | None = None
    latency_source: str | None = None  # the profile's: measured or modeled
    replay_exact: bool | None = None  # outside fp32: whether the acceptance was decoded with this plan's settings
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_fields(cls, f: Fields) -> Prediction:
        typed = {"tokens_per_step": f.number("tokens_per_step", low=1.0),
                 "speedup": f.number("speedup", required=False, low=0.0),
                 "step_seconds": f.number("step_seconds", required=False, low=0.0),
                 "tokens_per_second": f.number("tokens_per_second", required=False, low=0.0),
                 "seconds_per_token": f.number("seconds_per_token", required=False, low=0.0),
                 "latency_source": f.string("latency_source", required=False),
                 "replay_exact": f.boolean("replay_exact", default=None)}
        details = {k: v for k, v in f.data.items() if k not in typed}
        return cls(**typed, details=_finite_mapping(details, f.where))

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None and k != "details"}
        return {**out, **self.details}


def setting_name(method: str, nodes: int | None) -> str:
    """A schedule's setting as the method names it: Lookahead's decoding length, a hierarchy's gamma2, a chain's
    draft tokens K (None: off)."""
    if nodes is None:
        return "off"
    return {"lookahead": f"L_d={nodes}", "triforce": f"gamma2={nodes - 1}"}.get(method, f"K={nodes - 1}")


@dataclass(frozen=True)
class Candidate:
    """An "off" entry's best drafting setting, predicted below the schedule's margin but at least CANDIDATE_SPEEDUP
    times one-token decoding: where each request decides step by step whether to draft (decoder/gate.py), it drafts
    this once the steps' measured prices say it pays (a server's own work between steps, which no profile times, can
    tip it), and never otherwise."""

    decoding_length: int
    tokens_per_step: float  # per sequence
    speedup: float  # over no speculation at the entry's `low` sequences

    @classmethod
    def from_fields(cls, f: Fields) -> Candidate:
        return cls(f.token_count("decoding_length", low=2), f.number("tokens_per_step", low=1.0),
                   f.number("speedup", low=0.0))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ScheduleEntry:
    """The setting for steps of `low`..`high` sequences, and what it is predicted to give there."""

    low: int
    high: int
    speculate: bool
    decoding_length: int | None  # the draft's nodes per sequence, root included (TriForce: gamma2 + 1; None: off)
    tokens_per_step: float  # per sequence
    tokens_per_second: float  # over the whole batch, at `low` sequences
    speedup: float  # over no speculation at `low` sequences
    candidate: Candidate | None = None  # off only: the setting a per-request decision may draft once measured to pay
    # the priced setting's speedup (the setting's; off, its candidate's) at each of `low`..`high` sequences, which the
    # clock's prices borrowed from a near batch size are scaled by (decoder/gate.py); empty in plans solved before it:
    # the speedup at `low` holds at every size
    speedups: tuple[float, ...] = ()

    def nodes(self, gated: bool) -> int:
        """The nodes per sequence, root included, a drafter drafts at this entry: the setting's; off, its candidate's
        where a per-request decision (`gated`) keeps it from drafting until measured to pay; else 1 (none)."""
        if self.speculate:
            return self.decoding_length
        return self.candidate.decoding_length if gated and self.candidate is not None else 1

    def price_at(self, batch: int) -> tuple[float, float] | None:
        """The tokens per step and the speedup a drafted step of `batch` sequences is held to at this entry (beyond
        `high`, at `high`): the setting's, off its candidate's; None where it drafts nothing."""
        if self.speculate:
            tokens, speedup = self.tokens_per_step, self.speedup
        elif self.candidate is not None:
            tokens, speedup = self.candidate.tokens_per_step, self.candidate.speedup
        else:
            return None
        return tokens, (self.speedups[min(batch, self.high) - self.low] if self.speedups else speedup)

    @classmethod
    def from_fields(cls, f: Fields) -> ScheduleEntry:
        bounds = f.data.get("batches")
        if (not isinstance(bounds, list) or len(bounds) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in bounds)
                or bounds[0] > bounds[1]):
            raise f.fail("'batches' must be [low, high], batch sizes with 1 <= low <= high")
        speculate = f.boolean("speculate", default=True)
        length = f.token_count("decoding_length", required=speculate, low=2) if speculate else None
        if speculate and f.has("candidate"):
            raise f.fail("'candidate' is for entries that do not speculate")
        candidate = Candidate.from_fields(f.sub("candidate")) if f.has("candidate") else None
        speedups = f.number_list("speedups", required=False, low=0.0) or ()
        if speedups and (len(speedups) != bounds[1] - bounds[0] + 1 or not (speculate or candidate is not None)):
            raise f.fail("'speedups' must hold one speedup per batch size of the range, of a setting or a candidate")
        return cls(bounds[0], bounds[1], bool(speculate), length, f.number("tokens_per_step", low=1.0),
                   f.number("tokens_per_second", low=0.0), f.number("speedup", low=0.0), candidate, tuple(speedups))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"batches": [self.low, self.high], "speculate": self.speculate}
        if self.decoding_length is not None:
            out["decoding_length"] = self.decoding_length
        out = {**out, "tokens_per_step": self.tokens_per_step, "tokens_per_second": self.tokens_per_second,
               "speedup": self.speedup}
        if self.candidate is not None:
            out["candidate"] = self.candidate.to_dict()
        return {**out, "speedups": list(self.speedups)} if self.speedups else out


@dataclass(frozen=True)
class BatchSchedule:
    """A plan's setting per batch size (see the module's docstring), priced at `context` tokens, for sequences of up
    to `up_to_context` tokens (None: any); `longer`: the tables for longer sequences, each with its own range."""

    context: int | None
    entries: tuple[ScheduleEntry, ...]
    up_to_context: int | None = None
    longer: tuple[BatchSchedule, ...] = ()
    mix_shares: tuple[tuple[float, ...], ...] = ()  # at each batch size from 1 (the module's doc)

    @classmethod
    def merged(cls, context: int | None, per_batch: list[tuple[int | None, float, float, float, Candidate | None]],
               mix_shares: tuple[tuple[float, ...], ...] = ()) -> BatchSchedule:
        """The schedule of a setting chosen for each batch size 1, 2, ...: (decoding length, None: off; tokens per
        step, tokens/s, speedup; off, its candidate or None), each range of equal settings (and candidates' lengths)
        one entry predicted at its first size, with its priced setting's speedup at each size (the setting's; off, its
        candidate's, where it has one); `mix_shares`: at each size, its steps' where some of the sequences draft."""
        entries: list[ScheduleEntry] = []
        for batch, (length, per_step, rate, speedup, candidate) in enumerate(per_batch, start=1):
            last = entries[-1] if entries else None
            priced = (speedup,) if length is not None else (candidate.speedup,) if candidate is not None else ()
            if (last is not None and last.decoding_length == length
                    and _candidate_length(last.candidate) == _candidate_length(candidate)):
                entries[-1] = replace(last, high=batch, speedups=last.speedups + priced)
            else:
                entries.append(ScheduleEntry(batch, batch, length is not None, length, per_step, rate, speedup,
                                             candidate, priced))
        return cls(context, tuple(entries), mix_shares=mix_shares)

    @classmethod
    def by_context(cls, tables: list[BatchSchedule]) -> BatchSchedule:
        """One schedule of tables priced at increasing contexts: each covers the sequences up to the geometric mean of
        its context and the next one's (the last, every longer sequence)."""
        contexts = [table.context for table in tables]
        if len(tables) > 1 and (None in contexts or min(contexts) < 1 or len(set(contexts)) < len(contexts)):
            raise UserError(f"the contexts of a schedule's tables must be distinct and positive, got {contexts}")
        tables = sorted(tables, key=lambda table: table.context or 0)
        bounded = [replace(table, up_to_context=int((table.context * following.context) ** 0.5))
                   for table, following in zip(tables, tables[1:])] + [tables[-1]]
        return replace(bounded[0], longer=tuple(bounded[1:]))

    @cached_property
    def tables(self) -> tuple[BatchSchedule, ...]:
        """Every context range's table, shortest first (this one's own first). Kept: a decoder looks its entry up
        for every request at every step, and copying this table each time cost most of that look-up."""
        return (replace(self, longer=()), *self.longer)

    def entry_for(self, batch: int, context: int | None = None) -> ScheduleEntry:
        """The entry whose range holds `batch` sequences (the last beyond the last range), in the table of a
        sequence of `context` tokens (None: the first table)."""
        table = self.table_for(context)
        return next((e for e in table.entries if e.low <= batch <= e.high), table.entries[-1])

    def mix_share(self, batch: int, drafting: int, context: int | None = None) -> float | None:
        """What `drafting` of a step's `batch` sequences drafting add to a plain step, as a share of what all of them
        add, in the table of a sequence of `context` tokens; None where the plan priced no such step (nothing drafts
        there, beyond the sizes priced, or a plan solved before it did)."""
        if drafting <= 0 or drafting >= batch:
            return 0.0 if drafting <= 0 else 1.0
        shares = self.table_for(context).mix_shares
        if batch > len(shares) or not shares[batch - 1]:
            return None
        return float(np.interp(drafting, [0, *mix_points(batch), batch], [0.0, *shares[batch - 1], 1.0]))

    def table_for(self, context: int | None) -> BatchSchedule:
        """The table of a sequence of `context` tokens (None: the first)."""
        tables = self.tables
        return next((t for t in tables if context is None or t.up_to_context is None or context <= t.up_to_context),
                    tables[-1])

    @classmethod
    def from_fields(cls, f: Fields, largest_draft: int | None, nested: bool = False) -> BatchSchedule:
        raw = f.data.get("entries")
        if not isinstance(raw, list) or not raw:
            raise f.fail("'entries' must be a non-empty list")
        entries = tuple(ScheduleEntry.from_fields(Fields(e, f"{f.where}: entries[{i}]")) for i, e in enumerate(raw))
        expected = 1
        for entry in entries:
            if entry.low != expected:
                raise f.fail(f"the batch ranges must be contiguous from 1: expected a range from {expected}, got "
                             f"[{entry.low}, {entry.high}]")
            most = max(entry.decoding_length or 0, _candidate_length(entry.candidate) or 0)
            if largest_draft is not None and most > largest_draft:
                raise f.fail(f"decoding length {most} exceeds the plan's {largest_draft}")
            expected = entry.high + 1
        longer: tuple[BatchSchedule, ...] = ()
        if f.has("longer"):
            items = f.data["longer"]
            if nested or not isinstance(items, list) or not items:
                raise f.fail("'longer' must be a non-empty list of tables, at the top of the schedule only")
            longer = tuple(cls.from_fields(Fields(item, f"{f.where}: longer[{i}]"), largest_draft, nested=True)
                           for i, item in enumerate(items))
        raw_shares = f.data.get("mix_shares", [])
        if not isinstance(raw_shares, list) or not all(isinstance(shares, list) for shares in raw_shares):
            raise f.fail("'mix_shares' must be a list of lists of shares, one per batch size from 1")
        mix_shares = tuple(tuple(check_number(share, f"{f.where}: mix_shares[{i}][{j}]", 0.0, 1.0)
                                 for j, share in enumerate(shares)) for i, shares in enumerate(raw_shares))
        for batch, shares in enumerate(mix_shares, start=1):
            if shares and len(shares) != len(mix_points(batch)):
                raise f.fail(f"'mix_shares' at batch size {batch}: none, or one share at each of {mix_points(batch)} "
                             f"sequences drafting")
        schedule = cls(f.token_count("context", required=False), entries,
                       f.token_count("up_to_context", required=False), longer, mix_shares)
        tables = schedule.tables
        bounds = [table.up_to_context for table in tables]
        if bounds[-1] is not None or any(b is None for b in bounds[:-1]) or bounds[:-1] != sorted(set(bounds[:-1])):
            raise f.fail("the tables' 'up_to_context' must increase, and only the last table may go without one")
        return schedule

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"context": self.context} if self.context is not None else {}
        if self.up_to_context is not None:
            out["up_to_context"] = self.up_to_context
        out["entries"] = [e.to_dict() for e in self.entries]
        if self.mix_shares:
            out["mix_shares"] = [list(shares) for shares in self.mix_shares]
        if self.longer:
            out["longer"] = [table.to_dict() for table in self.longer]
        return out


def mix_points(batch: int) -> list[int]:
    """The numbers of a step's `batch` sequences drafting that a schedule's `mix_shares` are priced at: the powers of
    two below it (between them a step's rows grow linearly in the profile's t(B, n), and the draft's forwards
    little)."""
    return [1 << i for i in range(batch.bit_length()) if 1 << i < batch]


def _candidate_length(candidate: Candidate | None) -> int | None:
    return candidate.decoding_length if candidate is not None else None


@dataclass(frozen=True)
class RowSharing:
    """A Lookahead plan's rows shared among the requests of a step (decoder/sharing.py): the trie they draft from,
    each decoding length's tokens per step on the workload the plan was solved on (a request's prior), and a step's
    seconds at each batch size with each number of rows per sequence, 1 to the trie's decoding length, priced at
    `context` (t(B, n), the engine's overhead and the trie's work); a step drafts only where its allocation is
    expected `min_speedup` times as fast as none (the schedule's margin). `row_seconds`, where the profile timed one
    sequence's forward at every number of rows (`plan profile --row-totals`): that forward's seconds at 1, 2, ...
    rows, which price the steps whose rows are not a multiple of the batch size (`seconds`)."""

    trie: TrieSettings
    context: int
    tokens_per_step: dict[int, float]  # decoding length -> tokens per step; 1 (no draft) -> 1.0
    step_seconds: dict[int, tuple[float, ...]]  # batch size -> seconds at 1, 2, ..., trie.decoding_length rows
    min_speedup: float = 1.0
    row_seconds: tuple[float, ...] = ()  # one sequence's forward of 1, 2, ... rows at `context`

    @property
    def lengths(self) -> list[int]:
        """The decoding lengths a request may be given, 1 (none) first."""
        return sorted(self.tokens_per_step)

    def seconds(self, batch: int, rows: float) -> float:
        """A step of `batch` sequences scoring `rows` rows in all: on the straight line between the table's uniform
        steps either side (rows // batch rows per sequence and one more), moved, where `row_seconds` reaches the
        upper one, by as much as one sequence's forward of `rows` rows sits off the same line between its own
        timings at those two totals: a forward scores its rows in passes of a few (decoder/kernels/linear.cpp), so
        the first row of a pass costs the pass, which a line between uniform steps spreads over all of them. The
        largest batch size priced beyond it, per sequence."""
        largest = max(self.step_seconds)
        if batch > largest:
            return self.seconds(largest, rows * largest / batch) * batch / largest
        table = self.step_seconds[batch]
        per_sequence = min(max(rows / batch, 1.0), float(len(table)))
        low = int(per_sequence)
        share = per_sequence - low
        if not share:
            return table[low - 1]
        seconds = table[low - 1] + share * (table[low] - table[low - 1])
        below, above = batch * low, batch * (low + 1)
        if above <= len(self.row_seconds):
            forward = self.row_seconds
            seconds += self._forward(batch * per_sequence) - (
                forward[below - 1] + share * (forward[above - 1] - forward[below - 1]))
        return seconds

    def _forward(self, rows: float) -> float:
        """One sequence's forward of `rows` rows (linear between whole rows: a step beyond the largest batch size
        is priced at a fraction of it)."""
        low = int(rows)
        value = self.row_seconds[low - 1]
        return value + (rows - low) * (self.row_seconds[low] - value) if rows > low else value

    @classmethod
    def from_fields(cls, f: Fields) -> RowSharing:
        trie = TrieSettings.from_fields(f.sub("trie"))
        tokens = f.int_keyed_numbers("tokens_per_step", low=1.0, max_key=trie.decoding_length)
        if tokens.get(1) != 1.0 or any(value > length for length, value in tokens.items()):
            raise f.fail("'tokens_per_step' must hold 1: 1.0 and, at each decoding length, at most that many tokens")
        raw = f.sub("step_seconds")
        batches = sorted(token_count_key(key, raw.where) for key in raw.data)
        if batches != list(range(1, len(batches) + 1)):
            raise raw.fail("the batch sizes must run 1, 2, ... without a gap")
        steps = {}
        for key in raw.data:
            values = raw.number_list(key, low=0.0, high=MAX_SECONDS)
            if len(values) != trie.decoding_length or min(values) <= 0:
                raise raw.fail(f"batch {key}: {trie.decoding_length} positive seconds, one per rows per sequence")
            steps[token_count_key(key, raw.where)] = tuple(values)
        row_seconds = f.number_list("row_seconds", required=False, low=0.0, high=MAX_SECONDS) or []
        if any(value <= 0 for value in row_seconds):
            raise f.fail("'row_seconds' must be positive seconds, one per number of rows from 1")
        return cls(trie, f.token_count("context"), tokens, dict(sorted(steps.items())),
                   f.number("min_speedup", required=False, low=0.5, high=10.0, default=1.0), tuple(row_seconds))

    def to_dict(self) -> dict[str, Any]:
        return {"trie": self.trie.to_dict(), "context": self.context, "tokens_per_step": dict(self.tokens_per_step),
                "step_seconds": {batch: list(values) for batch, values in self.step_seconds.items()},
                "min_speedup": self.min_speedup,
                **({"row_seconds": list(self.row_seconds)} if self.row_seconds else {})}


@dataclass
class Plan:
    """A solved plan of any method; `params` holds the method-specific section (for Sequoia, the tree)."""

    method: str
    models: PlanModels
    prediction: Prediction
    inputs: dict[str, Any] = field(default_factory=dict)
    solver: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    tree: TokenTree | None = None
    settings: TrieSettings | TriForceSettings | PromptLookupSettings | NgramTreeSettings | None = None
    tokenizer: dict[str, Any] = field(default_factory=dict)
    engine: str = "specplan"  # the engine whose rules the tree was solved within (planner/engines.py)
    schedule: BatchSchedule | None = None  # the setting per batch size (`--batches`); None: this one at every size
    sharing: RowSharing | None = None  # a step's rows shared by the requests' yields (`--share-rows`)
    source: str = field(default="plan", compare=False)  # the file it was read from, for error messages

    @property
    def kind(self) -> str:
        return f"plan/{self.method}"

    @property
    def largest_setting(self) -> int | None:
        """The most nodes per sequence, root included, a schedule's entry or a fixed setting may ask of the plan's
        drafter (a Lookahead trie's decoding length, a chain's size, a hierarchy's gamma2 + 1, an engine's n-gram
        chain's tokens + 1); None: its drafter takes no length (a branching tree, a streaming draft, an n-gram tree,
        a plan that drafts nothing)."""
        if self.method == "lookahead":
            return self.settings.decoding_length
        if self.method == "sequoia" and self.tree.is_chain:
            return self.tree.size
        if self.method == "triforce" and self.settings.speculate and self.settings.bottom != "streaming":
            return self.settings.gamma2 + 1
        if self.method == "prompt-lookup" and isinstance(self.settings, PromptLookupSettings) and self.settings.enabled:
            return self.settings.num_tokens + 1
        return None

    @property
    def most_tokens_per_step(self) -> int:
        """The most tokens one drafted step can emit a sequence: its deepest draft path accepted whole and the target's
        next token (a hierarchy's chain collects middle rounds until it holds gamma2 tokens, its last round up to
        gamma1 + 1 of them: gamma1 + gamma2 in all)."""
        if self.method == "lookahead":
            return self.settings.branch_length + 1
        if self.method == "sequoia":
            return self.tree.depth + 1
        if self.method == "triforce":
            settings = self.settings
            if not settings.speculate:
                return 1
            return settings.gamma2 + 1 + (settings.gamma1 if settings.bottom in ("trie", "model") else 0)
        return self.settings.max_draft_tokens + 1  # prompt lookup

    def predicted_at(self, batch: int, context: int | None = None) -> tuple[float, float] | None:
        """The tokens per step and the speedup over one-token decoding the plan predicts for its drafted steps at
        `batch` sequences of `context` tokens (its schedule's entry there, else its batch-1 prediction): the price a
        request's own drafts are held to (decoder/gate.py). None where nothing is priced (no profile) or the schedule
        is off without a candidate (ScheduleEntry.price_at)."""
        if self.schedule is not None:
            return self.schedule.entry_for(batch, context).price_at(batch)
        if self.prediction.speedup is None:
            return None
        return self.prediction.tokens_per_step, self.prediction.speedup

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> Plan:
        f = Fields(data, where)
        kind = f.kind(PLAN_KINDS)
        method = kind.split("/", 1)[1]
        prediction = f.sub("prediction")
        plan = cls(
            method=method,
            models=PlanModels.from_fields(f.sub("models", required=False)),
            prediction=Prediction.from_fields(prediction),
            inputs=_finite_mapping(data.get("inputs"), f"{where}: inputs"),
            solver=_finite_mapping(data.get("solver"), f"{where}: solver"),
            provenance=_finite_mapping(data.get("provenance"), f"{where}: provenance"),
            sampling=_finite_mapping(data.get("sampling"), f"{where}: sampling"),
            engine=f.string("engine", required=False, default="specplan",
                            choices=tuple(dict.fromkeys(ENGINES + LOOKUP_ENGINES))),
            source=where,
        )
        tokens_per_step = plan.prediction.tokens_per_step
        if method == "sequoia":
            tree = f.sub("tree")
            plan.tree = TokenTree.from_parents(tree.data.get("parents") or [], f"{where}: tree.parents")
            size = tree.integer("size", low=1)
            depth = tree.integer("depth", low=0)
            if size != plan.tree.size:
                raise tree.fail(f"size {size} does not match the {plan.tree.size} parents")
            if depth != plan.tree.depth:
                raise tree.fail(f"depth {depth} does not match the tree's depth {plan.tree.depth}")
            if tokens_per_step > plan.tree.size:
                raise prediction.fail(f"tokens_per_step {tokens_per_step} exceeds the tree size {plan.tree.size}")
        if method == "lookahead":
            plan.settings = TrieSettings.from_fields(f.sub("lookahead"))
            tokenizer = f.sub("tokenizer")
            plan.tokenizer = {"vocab_size": tokenizer.integer("vocab_size", low=1),
                              "sha256": tokenizer.string("sha256")}
            if tokens_per_step > plan.settings.decoding_length:
                raise prediction.fail(f"tokens_per_step {tokens_per_step} exceeds the decoding length")
        if method == "triforce":
            plan.settings = TriForceSettings.from_fields(f.sub("triforce"))
        if method == "prompt-lookup":
            if plan.engine not in LOOKUP_ENGINES:
                raise f.fail(f"a prompt-lookup plan needs 'engine': one of {', '.join(LOOKUP_ENGINES)}")
            settings_type = NgramTreeSettings if plan.engine == "sglang" else PromptLookupSettings
            plan.settings = settings_type.from_fields(f.sub("prompt-lookup"))
            if tokens_per_step > plan.settings.max_draft_tokens + 1:
                raise prediction.fail(f"tokens_per_step {tokens_per_step} exceeds the draft length + 1")
        if f.has("schedule"):
            largest = plan.largest_setting
            if largest is None:
                raise f.fail("a schedule per batch size is for Lookahead plans, draft-model chains, n-gram chains "
                             "and TriForce hierarchies, not " + {
                                 "sequoia": "a branching tree", "triforce": "a plan without a middle level or one "
                                 "that drafts nothing", "prompt-lookup": "an n-gram tree or one that drafts nothing"
                             }.get(method, method))
            plan.schedule = BatchSchedule.from_fields(f.sub("schedule"), largest)
        if f.has("sharing"):
            if method != "lookahead":
                raise f.fail("rows shared by the requests' yields ('sharing') are for Lookahead plans")
            plan.sharing = RowSharing.from_fields(f.sub("sharing"))
        return plan

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "version": FORMAT_VERSION, "models": self.models.to_dict()}
        if self.engine != "specplan":
            out["engine"] = self.engine
        if self.sampling:
            out["sampling"] = self.sampling
        if self.tree is not None:
            out["tree"] = {"size": self.tree.size, "depth": self.tree.depth, "parents": list(self.tree.parents)}
        if self.settings is not None:
            out[self.method] = self.settings.to_dict()
        if self.tokenizer:
            out["tokenizer"] = self.tokenizer
        out["prediction"] = self.prediction.to_dict()
        if self.schedule is not None:
            out["schedule"] = self.schedule.to_dict()
        if self.sharing is not None:
            out["sharing"] = self.sharing.to_dict()
        out["inputs"] = self.inputs
        out["solver"] = self.solver
        out["provenance"] = self.provenance
        return out


def load_plan(path: str | os.PathLike) -> Plan:
    return Plan.from_dict(read_yaml(path), str(path))


def load_decoding_plan(path: str | os.PathLike, method: str, target: str, dtype: str) -> Plan:
    """A plan given to decode a measurement's outputs with (`--decode-with`): of `method`, for this target and
    dtype."""
    plan = load_plan(path)
    if plan.method != method:
        raise UserError(f"{path}: decoding these outputs needs a {method} plan, not a {plan.method} plan")
    if not same_model(plan.models.target, target):
        raise UserError(f"{path}: the plan is for {plan.models.target!r}, not {target!r}")
    if (plan.models.dtype or dtype) != dtype:
        raise UserError(f"{path}: the plan is for {plan.models.dtype}, not {dtype}")
    return plan


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write a plan after reading it back with the loader: a solver never writes a plan that does not load."""
    document = plain(plan.to_dict())
    Plan.from_dict(document, str(path))
    write_yaml(path, document)


def parents_array(tree: TokenTree) -> np.ndarray:
    return np.asarray(tree.parents, dtype=np.int64)
