"""Acceptance statistics files (`kind: acceptance/...`): what the profiler writes and the planner reads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.fileio import read_yaml
from core.validate import Fields, check_number

POSITIONAL_SUM_TOLERANCE = 1e-6


@dataclass
class SequoiaAcceptance:
    """The positional acceptance vector p: p[k-1] = P(the k-th sampled child is the one accepted)."""

    positional: np.ndarray
    stderr: np.ndarray | None = None
    target: str | None = None
    draft: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    samples: int | None = None
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
        return cls(
            positional=np.asarray(positional, dtype=np.float64),
            stderr=None if stderr is None else np.asarray(stderr, dtype=np.float64),
            target=models.string("target", required=False) if models else None,
            draft=models.string("draft", required=False) if models else None,
            temperature=f.number("temperature", required=False, low=0.0),
            top_p=f.number("top_p", required=False, low=0.0, high=1.0),
            samples=f.integer("samples", required=False, low=0),
            extra={k: v for k, v in data.items()
                   if k not in {"kind", "positional", "stderr", "models", "temperature", "top_p", "samples"}},
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "acceptance/sequoia"}
        if self.target or self.draft:
            out["models"] = {"target": self.target, "draft": self.draft}
        for key in ("temperature", "top_p", "samples"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["positional"] = [float(x) for x in self.positional]
        if self.stderr is not None:
            out["stderr"] = [float(x) for x in self.stderr]
        out.update(self.extra)
        return out


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
    tokenizer: dict[str, Any]
    records: list[LookaheadRecord]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> LookaheadAcceptance:
        f = Fields(data, where)
        f.kind("acceptance/lookahead")
        models = f.sub("models")
        tokenizer = f.sub("tokenizer")
        tokenizer.integer("vocab_size", low=1)
        tokenizer.string("sha256")
        raw = data.get("records")
        if not isinstance(raw, list) or not raw:
            raise f.fail("'records' must be a non-empty list")
        records = []
        for i, item in enumerate(raw):
            r = Fields(item, f"{where}: records[{i}]")
            token_lists = [r.data.get(key) for key in ("prompt", "output")]
            if not all(isinstance(tokens, list) and tokens and all(isinstance(t, int) and not isinstance(t, bool)
                                                                      and t >= 0 for t in tokens)
                       for tokens in token_lists):
                raise r.fail("'prompt' and 'output' must be non-empty lists of token ids")
            records.append(LookaheadRecord(str(r.data.get("id", i)), str(r.data.get("category", "")),
                                           *token_lists))
        return cls(target=models.string("target"), tokenizer=dict(tokenizer.data), records=records,
                   extra={k: v for k, v in data.items() if k not in {"kind", "models", "tokenizer", "records"}})

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "acceptance/lookahead", "models": {"target": self.target}, "tokenizer": self.tokenizer,
                **self.extra,
                "records": [{"id": r.id, "category": r.category, "prompt": r.prompt, "output": r.output}
                            for r in self.records]}


def load_lookahead_acceptance(path: str | os.PathLike) -> LookaheadAcceptance:
    return LookaheadAcceptance.from_dict(read_yaml(path), str(path))


TRIFORCE_ENTRY_FIELDS = ("context", "budget", "chunk", "stride")
TRIFORCE_DECODED_SETTINGS = ("bottom", "gamma1", "gamma2", "budget", "chunk", "stride")  # in `decoded_with`
TRIFORCE_GAMMA1 = tuple(range(1, 9))  # gamma1 values the planner searches; a trie's runs are recorded for each


@dataclass
class TriForceAcceptance:
    """Per (context, budget, chunk, stride): the middle level's (target over a retrieval cache) acceptance
    against the full target, and the bottom drafter's against the middle level. Per context (`streaming`,
    optional): the StreamingLLM-only draft's acceptance against the full target, `drafter` `draft` (the
    bottom model) or `target` (the target itself over the StreamingLLM cache), one trace per prompt."""

    target: str
    bottom: str  # "trie" or the bottom model's name
    entries: list[dict[str, Any]]
    temperature: float = 0.0
    streaming: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> TriForceAcceptance:
        f = Fields(data, where)
        f.kind("acceptance/triforce")
        models = f.sub("models")
        raw = data.get("entries")
        if not isinstance(raw, list) or not raw:
            raise f.fail("'entries' must be a non-empty list")
        entries = []
        for i, item in enumerate(raw):
            e = Fields(item, f"{where}: entries[{i}]")
            entry = {key: e.integer(key, low=1) for key in TRIFORCE_ENTRY_FIELDS}
            entry["middle"] = e.number("middle", low=0.0, high=1.0)
            entry["bottom"] = e.number("bottom", low=0.0, high=1.0)
            entry["traces"] = _traces(e)
            entry.update({k: v for k, v in item.items() if k not in entry})
            entries.append(entry)
        bottom = models.string("bottom")
        return cls(target=models.string("target"), bottom=bottom, entries=entries,
                   temperature=f.number("temperature", required=False, low=0.0, default=0.0),
                   streaming=_streaming_records(f, bottom),
                   extra={k: v for k, v in data.items()
                          if k not in {"kind", "models", "entries", "temperature", "streaming"}})

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "acceptance/triforce", "models": {"target": self.target, "bottom": self.bottom},
                "temperature": self.temperature, **self.extra, "streaming": self.streaming, "entries": self.entries}

    def streaming_at(self, context: int) -> dict[str, Any] | None:
        return next((r for r in self.streaming if r["context"] == context), None)


def _streaming_records(f: Fields, bottom: str) -> list[dict[str, Any]]:
    raw = f.data.get("streaming") or []
    if not isinstance(raw, list):
        raise f.fail("'streaming' must be a list")
    records = []
    for i, item in enumerate(raw):
        r = Fields(item, f"{f.where}: streaming[{i}]")
        record = {"context": r.integer("context", low=1), "drafter": r.string("drafter"),
                  "acceptance": r.number("acceptance", low=0.0, high=1.0)}
        if record["drafter"] not in ("draft", "target"):
            raise r.fail("'drafter' must be draft or target")
        if record["drafter"] == "draft" and bottom == "trie":
            raise r.fail("a streaming draft model needs a model bottom")
        traces = r.data.get("traces")
        if not (isinstance(traces, list) and traces and all(isinstance(t, list) and t for t in traces)):
            raise r.fail("'traces' must be a non-empty list of non-empty per-prompt lists")
        record["traces"] = [np.array([check_number(v, f"{r.where}: traces[{j}][{k}]", 0.0, 1.0)
                                      for k, v in enumerate(trace)]) for j, trace in enumerate(traces)]
        record.update({k: v for k, v in item.items() if k not in record})
        records.append(record)
    return records


def _traces(entry: Fields) -> list[dict[str, np.ndarray]]:
    """Per prompt, the middle and bottom acceptances at each continuation position (optional), and for a trie
    bottom at T = 0 its accepted runs: one string per gamma1 in TRIFORCE_GAMMA1, one digit per position."""
    raw = entry.data.get("traces")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise entry.fail("'traces' must be a list")
    traces = []
    for i, item in enumerate(raw):
        t = Fields(item, f"{entry.where}: traces[{i}]")
        middle, bottom = (t.number_list(key, low=0.0, high=1.0) for key in ("middle", "bottom"))
        if not middle or len(middle) != len(bottom):
            raise t.fail("'middle' and 'bottom' must be non-empty and of equal length")
        trace = {"middle": np.array(middle), "bottom": np.array(bottom)}
        runs = t.data.get("bottom_runs")
        if runs is not None:
            if not (isinstance(runs, list) and len(runs) == len(TRIFORCE_GAMMA1) and all(
                    isinstance(r, str) and len(r) == len(middle) and all("0" <= c <= str(gamma1) for c in r)
                    for gamma1, r in zip(TRIFORCE_GAMMA1, runs))):
                raise t.fail(f"'bottom_runs' must hold {len(TRIFORCE_GAMMA1)} strings of one digit per position, "
                             "none above its gamma1")
            trace["bottom_runs"] = np.array([[int(c) for c in r] for r in runs], dtype=np.int64)
        traces.append(trace)
    return traces


def load_triforce_acceptance(path: str | os.PathLike) -> TriForceAcceptance:
    return TriForceAcceptance.from_dict(read_yaml(path), str(path))
