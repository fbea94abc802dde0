"""Latency profiles (`kind: profile/latency`): t(n) of the target per context length and the draft's step cost.

The minimal form, which stays loadable:

    kind: profile/latency
    target: {t_seconds: {1: 0.035, 2: 0.036, 16: 0.07}}
    draft: {step_seconds: 0.004}

The profiler adds `target.contexts: {L: {t_seconds: {...}, spread_seconds: {...}}}`, `draft.contexts`,
`source` (measured or modeled), `dtype`, `hardware`, `models` and, when the draft was timed scoring only the
token ids below some size (plus the stop tokens), `draft_vocab`. A measured profile also gives, per context,
`retrieval_build_seconds: {B: seconds}`: one TriForce retrieval-cache build keeping B of the L tokens, and
`target.engine_overhead_seconds: {n: seconds}`: the decoding engine's time per step outside the target's
forward for a draft tree of n nodes (at the context `target.engine_overhead_context`). Profiled with
`--window-prefill`, the draft's section (the target's where there is no draft) gives `window_prefill: {sinks,
window, seconds}`: a StreamingLLM drafter's prefill of its window, paid once per prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.interpolate import PchipInterpolator

from core.fileio import read_yaml
from core.machine import machine_identity
from core.validate import Fields


class LatencyCurve:
    """t(n) from measured points, interpolated monotonically (PCHIP) between them; no extrapolation."""

    def __init__(self, t_seconds: dict[int, float]) -> None:
        self.points = dict(sorted(t_seconds.items()))
        sizes = np.array(list(self.points), dtype=np.float64)
        times = np.array(list(self.points.values()), dtype=np.float64)
        self._interp = PchipInterpolator(sizes, times) if len(sizes) > 1 else None
        self.max_n = int(sizes[-1])
        self.min_n = int(sizes[0])

    def support(self, largest: int) -> list[int]:
        """The sizes whose times determine t(n) for every n <= largest: PCHIP's slope at a point reads its two
        neighbours, so the curve up to `largest` reads two profiled sizes beyond it."""
        sizes = list(self.points)
        above = [n for n in sizes if n > largest][:2]
        return [n for n in sizes if n <= largest] + above

    def __call__(self, n: int | np.ndarray) -> np.ndarray:
        n_arr = np.asarray(n, dtype=np.float64)
        if np.any(n_arr < self.min_n) or np.any(n_arr > self.max_n):
            raise ValueError(f"t(n) is profiled for n in [{self.min_n}, {self.max_n}] only")
        if self._interp is None:
            return np.full_like(n_arr, next(iter(self.points.values())))
        return self._interp(n_arr)


@dataclass
class LatencyProfile:
    target_t_seconds: dict[int, float]
    draft_step_seconds: float | None = None
    target_context: int | None = None
    target_by_context: dict[int, dict[int, float]] = field(default_factory=dict)
    draft_by_context: dict[int, float] = field(default_factory=dict)
    source: str = "measured"
    draft_vocab: int | None = None  # the draft's step was timed scoring only the ids below this (+ stop tokens)
    builds_by_context: dict[int, dict[int, float]] = field(default_factory=dict)  # {L: {budget: seconds}}
    overhead_seconds: dict[int, float] = field(default_factory=dict)  # {n: engine seconds per step outside t(n)}
    window_prefills: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # {role: (sinks, window, s)}
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> LatencyProfile:
        f = Fields(data, where)
        f.kind("profile/latency")
        target = f.sub("target")
        t_seconds = target.int_keyed_numbers("t_seconds", low=0.0)
        if 1 not in t_seconds:
            raise target.fail("'t_seconds' must include n = 1 (speedups are relative to t(1))")
        if min(t_seconds) < 1:
            raise target.fail("'t_seconds' keys must be >= 1")
        if t_seconds[1] <= 0:
            raise target.fail("t(1) must be > 0")
        by_context: dict[int, dict[int, float]] = {}
        builds: dict[int, dict[int, float]] = {}
        contexts = target.sub("contexts", required=False)
        if contexts is not None:
            for key in contexts.data:
                entry = Fields(contexts.data[key], f"{contexts.where}: {key}")
                by_context[int(key)] = entry.int_keyed_numbers("t_seconds", low=0.0)
                if entry.has("retrieval_build_seconds"):
                    builds[int(key)] = entry.int_keyed_numbers("retrieval_build_seconds", low=0.0)
        draft = f.sub("draft", required=False)
        draft_step = draft.number("step_seconds", required=False, low=0.0) if draft else None
        draft_by_context: dict[int, float] = {}
        if draft is not None and draft.has("contexts"):
            dctx = draft.sub("contexts")
            for key in dctx.data:
                entry = Fields(dctx.data[key], f"{dctx.where}: {key}")
                draft_by_context[int(key)] = entry.number("step_seconds", low=0.0)
        window_prefills = {}
        for role, section in (("target", target), ("draft", draft)):
            if section is not None and section.has("window_prefill"):
                prefill = section.sub("window_prefill")
                window_prefills[role] = (prefill.integer("sinks", low=0), prefill.integer("window", low=1),
                                         prefill.number("seconds", low=0.0))
        source = f.string("source", required=False, default="measured")
        if source not in ("measured", "modeled"):
            raise f.fail(f"'source' must be measured or modeled, got {source!r}")
        return cls(
            target_t_seconds=t_seconds,
            draft_step_seconds=draft_step,
            target_context=target.integer("context", required=False, low=1),
            target_by_context=by_context,
            draft_by_context=draft_by_context,
            source=source,
            draft_vocab=f.integer("draft_vocab", required=False, low=1),
            builds_by_context={L: points for L, points in builds.items() if points},
            overhead_seconds=target.int_keyed_numbers("engine_overhead_seconds", low=0.0)
            if target.has("engine_overhead_seconds") else {},
            window_prefills=window_prefills,
            raw=data,
        )

    def target_curve(self, context: int | None = None) -> LatencyCurve:
        if context is None or context == self.target_context:
            return LatencyCurve(self.target_t_seconds)
        if context not in self.target_by_context:
            known = sorted(self.target_by_context)
            raise ValueError(f"the profile has no context {context} (it has {known})")
        return LatencyCurve(self.target_by_context[context])

    def latency(self, n: int | np.ndarray, context: float) -> np.ndarray:
        """t(n) at any context length: PCHIP in n at each profiled context, linear in between (clamped)."""
        curves = self._curves
        contexts = sorted(curves)
        context = min(max(context, contexts[0]), contexts[-1])
        upper = next(i for i, L in enumerate(contexts) if L >= context)
        if contexts[upper] == context or upper == 0:
            return curves[contexts[upper]](n)
        low, high = contexts[upper - 1], contexts[upper]
        weight = (context - low) / (high - low)
        return (1 - weight) * curves[low](n) + weight * curves[high](n)

    @functools.cached_property
    def _curves(self) -> dict[int, LatencyCurve]:
        by_context = self.target_by_context or {self.target_context or 0: self.target_t_seconds}
        return {L: LatencyCurve(points) for L, points in by_context.items()}

    def retrieval_build(self, context: float, budget: int) -> float | None:
        """Seconds per retrieval-cache build keeping `budget` of `context` tokens: linear in the budget at each
        profiled context that has builds, then in the context (both clamped); None if none was timed."""
        if not self.builds_by_context:
            return None
        at_context = {L: _linear(points, budget) for L, points in self.builds_by_context.items()}
        return _linear(at_context, context)

    def engine_overhead(self, n: int | np.ndarray) -> np.ndarray:
        """The engine's seconds per step outside the target's forward for a tree of n nodes: linear between the
        profiled sizes (clamped); 0 for a profile that has none (modeled, or older)."""
        if not self.overhead_seconds:
            return np.zeros_like(np.asarray(n, dtype=np.float64))
        sizes = sorted(self.overhead_seconds)
        return np.interp(np.asarray(n, dtype=np.float64), sizes, [self.overhead_seconds[k] for k in sizes])

    def draft_step(self, context: float | None = None) -> float | None:
        """The draft's one-token step over `context` cached tokens: linear between its profiled contexts
        (clamped); the base context's step where no context is given or the profile lists none."""
        if context is None or not self.draft_by_context:
            return self.draft_step_seconds
        return _linear(self.draft_by_context, context)

    def window_prefill(self, role: str, sinks: int, window: int) -> float | None:
        """Seconds for the `role` model (target or draft), as a StreamingLLM drafter, to prefill a window of
        `sinks` + `window` tokens; None unless profiled with those sizes."""
        profiled = self.window_prefills.get(role)
        return profiled[2] if profiled is not None and profiled[:2] == (sinks, window) else None

    def with_points(self, target: dict[int, dict[int, float]], builds: dict[int, dict[int, float]],
                    draft: dict[int, float], window_prefill: dict[str, float] | None = None) -> LatencyProfile:
        """A copy with these points (target t(n) per context, builds per context and budget, draft steps per
        context, window prefills per role) replaced by the given times: the same prices re-timed."""
        def merged(points: dict, new: dict) -> dict:
            return {key: {**value, **new.get(key, {})} for key, value in points.items()}

        base = self.target_t_seconds
        if self.target_context in target:
            base = {**base, **target[self.target_context]}
        return dataclasses.replace(self, target_t_seconds=base,
                                   target_by_context=merged(self.target_by_context, target),
                                   builds_by_context=merged(self.builds_by_context, builds),
                                   draft_by_context={**self.draft_by_context, **draft},
                                   window_prefills={**self.window_prefills, **{
                                       role: (*self.window_prefills[role][:2], seconds)
                                       for role, seconds in (window_prefill or {}).items()}})

    @property
    def machine(self) -> dict[str, Any]:
        """The machine the timings describe (core.machine.machine_identity of `hardware`)."""
        hardware = self.raw.get("hardware")
        return machine_identity(hardware if isinstance(hardware, dict) else {})

    def plan_inputs(self, path: str | os.PathLike) -> dict[str, Any]:
        """What a plan records of the profile it was solved with."""
        return {"file": str(path), "source": self.source, "machine": self.machine}

    @property
    def models(self) -> dict[str, Any]:
        models = self.raw.get("models")
        return models if isinstance(models, dict) else {}


def covering(keys: Iterable[int], low: float, high: float) -> list[int]:
    """The keys whose values a clamped linear interpolation reads anywhere in [low, high]."""
    ordered = sorted(keys)
    first = max([k for k in ordered if k <= low], default=ordered[0])
    last = min([k for k in ordered if k >= high], default=ordered[-1])
    return [k for k in ordered if first <= k <= last]


def _linear(points: dict[int, float], x: float) -> float:
    """The value at x, linear between the points' keys and clamped outside them."""
    keys = sorted(points)
    return float(np.interp(x, keys, [points[k] for k in keys]))


def load_profile(path: str | os.PathLike) -> LatencyProfile:
    return LatencyProfile.from_dict(read_yaml(path), str(path))
