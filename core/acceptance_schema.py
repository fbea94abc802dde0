"""Acceptance statistics files (`kind: acceptance/...`): what the profiler writes and the planner reads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from specplan.core.fileio import read_yaml
from specplan.core.validate import FORMAT_VERSION, MAX_VOCABULARY, Fields, check_number

POSITIONAL_SUM_TOLERANCE = 1e-6


@dataclass
class DraftChainTrace:
    """One prompt at T = 0, per position of the target's own continuation (the draft teacher-forced on it): whether
    the draft's argmax is the target's token, and the draft's confidence in its argmax as llama.cpp's draft sampler
    reports it (the top-1 probability renormalized over the top DRAFT_SAMPLER_TOP_K; `--draft-p-min` compares it).
    A chain drafted from position p is accepted up to its first miss, so replaying these is exact for what a step
    yields; where a chain runs on past a miss, its confidences there are the teacher-forced ones (an estimate)."""

    match: np.ndarray  # [positions] bool
    confidence: np.ndarray  # [positions] float
    prompt_tokens: int | None = None  # the prompt's length: what the draft prefills before its first draft
    # [positions] int: the target's token's rank among the draft's top `width` (teacher-forced), `width` where it is
    # none of them: at T = 0 a tree drafted there is accepted down the children of these ranks, so any tree replays
    ranks: np.ndarray | None = None

    @classmethod
    def from_fields(cls, t: Fields) -> DraftChainTrace:
        match = t.data.get("match")
        if not isinstance(match, str) or not match or set(match) - {"0", "1"}:
            raise t.fail("'match' must be a non-empty string of 0s and 1s, one per position")
        confidence = t.number_list("confidence", low=0.0, high=1.0)
        if len(confidence) != len(match):
            raise t.fail("'confidence' must have one entry per position of 'match'")
        ranks = t.data.get("ranks")
        if ranks is not None:
            if not isinstance(ranks, str) or len(ranks) != len(match) or set(ranks) - set(RANK_DIGITS):
                raise t.fail(f"'ranks' must be a string of one digit of {RANK_DIGITS!r} per position of 'match'")
            ranks = np.array([RANK_DIGITS.index(c) for c in ranks])
            if not np.array_equal(ranks == 0, np.array([c == "1" for c in match])):
                raise t.fail("'ranks' must be 0 exactly where 'match' is 1")
        return cls(np.array([c == "1" for c in match]), np.array(confidence),
                   t.integer("prompt_tokens", required=False, low=1), ranks)

    def to_dict(self) -> dict[str, Any]:
        return {**({"prompt_tokens": self.prompt_tokens} if self.prompt_tokens is not None else {}),
                "match": "".join("1" if m else "0" for m in self.match),
                **({"ranks": "".join(RANK_DIGITS[min(int(r), len(RANK_DIGITS) - 1)] for r in self.ranks)}
                   if self.ranks is not None else {}),
                "confidence": [round(float(c), CONFIDENCE_DECIMALS) for c in self.confidence]}


DRAFT_SAMPLER_TOP_K = 10  # llama.cpp's draft sampler keeps the top 10 candidates (planner/engines.py cites it)
CONFIDENCE_DECIMALS = 4  # the planner searches --draft-p-min in steps of 0.05
RANK_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"  # a chain trace's ranks, one digit each (widths up to 35)


@dataclass
class SequoiaAcceptance:
    """The positional acceptance vector p: p[k-1] = P(the k-th sampled child is the one accepted); at T = 0 also
    each prompt's chain trace (what the chain engines' knobs are replayed over)."""

    positional: np.ndarray
    stderr: np.ndarray | None = None
    target: str | None = None
    draft: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    samples: int | None = None
    chains: list[DraftChainTrace] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def draft_vocab(self) -> int | None:
        """The draft scored only the ids below this (plus the stop tokens); None: the whole vocabulary."""
        return self.extra.get("draft_vocab")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> SequoiaAcceptance:
        f = Fields(data, where)
        f.kind("acceptance/sequoia")
        positional = f.number_list("positional", low=0.0, high=1.0)
        if not positional:
            raise f.fail("'positional' is empty")
        total = sum(positional)
        if total > 1.0 + POSITIONAL_SUM_TOLERANCE:
            raise f.fail(f"'positional' sums to {total:.6f} > 1: the k-th-child acceptances are exclusive events")
        stderr = f.number_list("stderr", required=False, low=0.0)
        if stderr is not None and len(stderr) != len(positional):
            raise f.fail("'stderr' must have one entry per positional entry")
        models = f.sub("models", required=False)
        f.integer("draft_vocab", required=False, low=1)
        raw_chains = data.get("chains", [])
        if not isinstance(raw_chains, list):
            raise f.fail("'chains' must be a list")
        chains = [DraftChainTrace.from_fields(Fields(item, f"{where}: chains[{i}]"))
                  for i, item in enumerate(raw_chains)]
        return cls(
            positional=np.asarray(positional, dtype=np.float64),
            stderr=None if stderr is None else np.asarray(stderr, dtype=np.float64),
            target=models.string("target", required=False) if models else None,
            draft=models.string("draft", required=False) if models else None,
            temperature=f.number("temperature", required=False, low=0.0),
            top_p=f.number("top_p", required=False, low=0.0, high=1.0),
            samples=f.integer("samples", required=False, low=0),
            chains=chains,
            extra={k: v for k, v in data.items()
                   if k not in {"kind", "version", "positional", "stderr", "models", "temperature", "top_p",
                                "samples", "chains"}},
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "acceptance/sequoia", "version": FORMAT_VERSION}
        if self.target or self.draft:
            out["models"] = {"target": self.target, "draft": self.draft}
        for key in ("temperature", "top_p", "samples"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["positional"] = [float(x) for x in self.positional]
        if self.stderr is not None:
            out["stderr"] = [float(x) for x in self.stderr]
        out.update(self.extra)
        if self.chains:
            out["chains"] = [chain.to_dict() for chain in self.chains]
        return out

    def cut(self, output_tokens: int | None) -> SequoiaAcceptance:
        """The acceptance with each chain trace cut to its first `output_tokens` positions (None: whole): the
        continuations of requests of that many new tokens, over which the draft's prompt prefill is spread and
        whose steps replay exactly. Traces are not extended: a continuation the file ended sooner stays as it is."""
        if output_tokens is None:
            return self
        return replace(self, chains=[replace(chain, match=chain.match[:output_tokens],
                                             confidence=chain.confidence[:output_tokens],
                                             ranks=None if chain.ranks is None else chain.ranks[:output_tokens])
                                     for chain in self.chains])


def load_sequoia_acceptance(path: str | os.PathLike) -> SequoiaAcceptance:
    return SequoiaAcceptance.from_dict(read_yaml(path), str(path))


@dataclass
class LookaheadRecord:
    id: str
    category: str
    prompt: list[int]
    output: list[int]


@dataclass
class LookaheadAcceptance:
    """The target's greedy outputs on a dataset, in order: what an offline trie replay needs."""

    target: str
    tokenizer: dict[str, Any]  # {vocab_size, sha256}: a trie plan holds token ids of this tokenizer
    records: list[LookaheadRecord]
    dtype: str | None = None
    decoded_with: tuple[int, int] | None = None  # (L_d, L_b) of the Lookahead plan whose decoding gave the outputs
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> LookaheadAcceptance:
        f = Fields(data, where)
        f.kind("acceptance/lookahead")
        models = f.sub("models")
        tokenizer = f.sub("tokenizer")
        vocab_size = tokenizer.integer("vocab_size", low=1, high=MAX_VOCABULARY)
        tokenizer.string("sha256")
        raw = data.get("records")
        if not isinstance(raw, list) or not raw:
            raise f.fail("'records' must be a non-empty list")
        records = []
        for i, item in enumerate(raw):
            r = Fields(item, f"{where}: records[{i}]")
            token_lists = [r.data.get(key) for key in ("prompt", "output")]
            if not all(isinstance(tokens, list) and tokens and all(isinstance(t, int) and not isinstance(t, bool)
                                                                      and 0 <= t < vocab_size for t in tokens)
                       for tokens in token_lists):
                raise r.fail(f"'prompt' and 'output' must be non-empty lists of token ids below the vocabulary size "
                             f"{vocab_size}")
            records.append(LookaheadRecord(str(r.data.get("id", i)), str(r.data.get("category", "")),
                                           *token_lists))
        decoded = f.sub("decoded_with", required=False)
        return cls(target=models.string("target"), tokenizer=dict(tokenizer.data), records=records,
                   dtype=f.string("dtype", required=False),
                   decoded_with=(decoded.token_count("decoding_length"), decoded.token_count("branch_length"))
                   if decoded else None,
                   extra={k: v for k, v in data.items()
                          if k not in {"kind", "version", "models", "tokenizer", "records", "dtype",
                                       "decoded_with"}})

    def cut(self, output_tokens: int | None) -> list[LookaheadRecord]:
        """The records with each output cut to its first `output_tokens` (None: whole): the greedy outputs of
        requests of that many new tokens, so a replay over them stays exact for such requests."""
        if output_tokens is None:
            return self.records
        return [replace(record, output=record.output[:output_tokens]) for record in self.records]

    def to_dict(self) -> dict[str, Any]:
        decoded = None if self.decoded_with is None else dict(zip(("decoding_length", "branch_length"),
                                                                  self.decoded_with))
        return {"kind": "acceptance/lookahead", "version": FORMAT_VERSION, "models": {"target": self.target},
                "tokenizer": self.tokenizer,
                **({"dtype": self.dtype} if self.dtype is not None else {}), "decoded_with": decoded, **self.extra,
                "records": [{"id": r.id, "category": r.category, "prompt": r.prompt, "output": r.output}
                            for r in self.records]}


def load_lookahead_acceptance(path: str | os.PathLike) -> LookaheadAcceptance:
    return LookaheadAcceptance.from_dict(read_yaml(path), str(path))


TRIFORCE_DECODED_SETTINGS = ("bottom", "gamma1", "gamma2", "budget", "chunk", "stride")  # in `decoded_with`
TRIFORCE_GAMMA1 = tuple(range(1, 9))  # gamma1 values the planner searches; a trie's runs are recorded for each
STREAMING_DRAFTERS = ("draft", "target")


@dataclass
class TriForceTrace:
    """One prompt's acceptances per continuation position: the middle level's by the full target, the bottom
    drafter's by the middle level; for a trie bottom at T = 0, its accepted run at each position for each gamma1
    in TRIFORCE_GAMMA1 (stored as one string of digits per gamma1)."""

    middle: np.ndarray  # [positions] float
    bottom: np.ndarray  # [positions] float
    bottom_runs: np.ndarray | None = None  # [len(TRIFORCE_GAMMA1), positions] int

    @classmethod
    def from_fields(cls, t: Fields) -> TriForceTrace:
        middle, bottom = (t.number_list(key, low=0.0, high=1.0) for key in ("middle", "bottom"))
        if not middle or len(middle) != len(bottom):
            raise t.fail("'middle' and 'bottom' must be non-empty and of equal length")
        runs = t.data.get("bottom_runs")
        if runs is not None:
            if not (isinstance(runs, list) and len(runs) == len(TRIFORCE_GAMMA1) and all(
                    isinstance(r, str) and len(r) == len(middle) and all("0" <= c <= str(gamma1) for c in r)
                    for gamma1, r in zip(TRIFORCE_GAMMA1, runs))):
                raise t.fail(f"'bottom_runs' must hold {len(TRIFORCE_GAMMA1)} strings of one digit per position, "
                             "none above its gamma1")
            runs = np.array([[int(c) for c in r] for r in runs], dtype=np.int64)
        return cls(np.array(middle), np.array(bottom), runs)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"middle": _stored(self.middle), "bottom": _stored(self.bottom)}
        if self.bottom_runs is not None:
            out["bottom_runs"] = ["".join(str(int(run)) for run in row) for row in self.bottom_runs]
        return out


@dataclass
class TriForceEntry:
    """One retrieval-cache setting (context, budget, chunk, stride): the mean acceptances and their traces."""

    context: int
    budget: int
    chunk: int
    stride: int
    middle: float  # the middle level's acceptance by the full target
    bottom: float  # the bottom drafter's acceptance by the middle level
    traces: list[TriForceTrace] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # stderrs, positions

    @classmethod
    def from_fields(cls, e: Fields) -> TriForceEntry:
        budget, chunk = e.token_count("budget"), e.token_count("chunk")
        if chunk >= budget or budget % chunk:
            raise e.fail(f"the chunk ({chunk}) must divide the budget ({budget}) and be smaller")
        raw = e.data.get("traces")
        if raw is not None and not isinstance(raw, list):
            raise e.fail("'traces' must be a list")
        traces = [TriForceTrace.from_fields(Fields(item, f"{e.where}: traces[{i}]"))
                  for i, item in enumerate(raw or [])]
        known = {"context", "budget", "chunk", "stride", "middle", "bottom", "traces"}
        return cls(e.token_count("context"), budget, chunk, e.token_count("stride"),
                   e.number("middle", low=0.0, high=1.0), e.number("bottom", low=0.0, high=1.0), traces,
                   {k: v for k, v in e.data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        return {"context": self.context, "budget": self.budget, "chunk": self.chunk, "stride": self.stride,
                "middle": self.middle, "bottom": self.bottom, **self.extra,
                "traces": [trace.to_dict() for trace in self.traces]}


@dataclass
class StreamingRecord:
    """The StreamingLLM-only draft at one context: `drafter` draft (the bottom model) or target (the target
    itself over the StreamingLLM cache), its acceptance by the full target, one trace per prompt."""

    context: int
    drafter: str  # one of STREAMING_DRAFTERS
    acceptance: float
    traces: list[np.ndarray]  # per prompt: [positions] float
    extra: dict[str, Any] = field(default_factory=dict)  # stderr, positions

    @classmethod
    def from_fields(cls, r: Fields, bottom: str) -> StreamingRecord:
        drafter = r.string("drafter")
        if drafter not in STREAMING_DRAFTERS:
            raise r.fail("'drafter' must be draft or target")
        if drafter == "draft" and bottom == "trie":
            raise r.fail("a streaming draft model needs a model bottom")
        traces = r.data.get("traces")
        if not (isinstance(traces, list) and traces and all(isinstance(t, list) and t for t in traces)):
            raise r.fail("'traces' must be a non-empty list of non-empty per-prompt lists")
        values = [np.array([check_number(v, f"{r.where}: traces[{j}][{k}]", 0.0, 1.0) for k, v in enumerate(trace)])
                  for j, trace in enumerate(traces)]
        known = {"context", "drafter", "acceptance", "traces"}
        return cls(r.token_count("context"), drafter, r.number("acceptance", low=0.0, high=1.0), values,
                   {k: v for k, v in r.data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        return {"context": self.context, "drafter": self.drafter, "acceptance": self.acceptance, **self.extra,
                "traces": [_stored(trace) for trace in self.traces]}


@dataclass
class TriForceAcceptance:
    """Per (context, budget, chunk, stride) a TriForceEntry; per context (optional) a StreamingRecord."""

    target: str
    bottom: str  # "trie" or the bottom model's name
    entries: list[TriForceEntry]
    temperature: float = 0.0
    streaming: list[StreamingRecord] = field(default_factory=list)
    bottom_cache: tuple[int, int] | None = None  # the bottom model's StreamingLLM cache: (sinks, window)
    decoded_with: dict[str, Any] | None = None  # the plan whose decoding was replayed: file and settings
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> TriForceAcceptance:
        f = Fields(data, where)
        f.kind("acceptance/triforce")
        models = f.sub("models")
        bottom = models.string("bottom")
        raw = data.get("entries")
        if not isinstance(raw, list) or not raw:
            raise f.fail("'entries' must be a non-empty list")
        streaming = data.get("streaming") or []
        if not isinstance(streaming, list):
            raise f.fail("'streaming' must be a list")
        cache = f.sub("bottom_cache", required=False)
        known = {"kind", "version", "models", "entries", "temperature", "streaming", "bottom_cache", "decoded_with"}
        return cls(
            target=models.string("target"), bottom=bottom,
            entries=[TriForceEntry.from_fields(Fields(item, f"{where}: entries[{i}]")) for i, item in enumerate(raw)],
            temperature=f.number("temperature", required=False, low=0.0, default=0.0),
            streaming=[StreamingRecord.from_fields(Fields(item, f"{where}: streaming[{i}]"), bottom)
                       for i, item in enumerate(streaming)],
            bottom_cache=(cache.token_count("sinks", low=0), cache.token_count("window")) if cache else None,
            decoded_with=_decoded_with(f.sub("decoded_with", required=False)),
            extra={k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "acceptance/triforce", "version": FORMAT_VERSION,
                               "models": {"target": self.target, "bottom": self.bottom},
                               "temperature": self.temperature, **self.extra}
        out["bottom_cache"] = None if self.bottom_cache is None else dict(zip(("sinks", "window"), self.bottom_cache))
        out["decoded_with"] = self.decoded_with
        out["streaming"] = [record.to_dict() for record in self.streaming]
        out["entries"] = [entry.to_dict() for entry in self.entries]
        return out

    def streaming_at(self, context: int) -> StreamingRecord | None:
        return next((r for r in self.streaming if r.context == context), None)


def _decoded_with(section: Fields | None) -> dict[str, Any] | None:
    if section is None:
        return None
    values = {key: section.token_count(key, low=0 if key == "gamma1" else 1)  # gamma1 0: no bottom level
              for key in TRIFORCE_DECODED_SETTINGS if key != "bottom"}
    return {**section.data, **values, "bottom": section.string("bottom")}


def _stored(values: np.ndarray) -> list:
    """A trace as the file holds it: 0/1 integers at T = 0, else probabilities."""
    return values.tolist()


def load_triforce_acceptance(path: str | os.PathLike) -> TriForceAcceptance:
    return TriForceAcceptance.from_dict(read_yaml(path), str(path))
