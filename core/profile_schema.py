"""Latency profiles (`kind: profile/latency`): t(n) of the target per context length and the draft's step cost.

The minimal form, which stays loadable:

    kind: profile/latency
    target: {t_seconds: {1: 0.035, 2: 0.036, 16: 0.07}}
    draft: {step_seconds: 0.004}

The profiler adds `target.contexts: {L: {t_seconds: {...}, spread_seconds: {...}}}`, `draft.contexts`,
`source` (measured or modeled), `backend` (the forward timed: lean, or transformers' own; lean when absent),
`dtype`, `hardware`, `models` and, when the draft was timed scoring only the
token ids below some size (plus the stop tokens), `draft_vocab`. A measured profile also gives, per context,
`retrieval_build_seconds: {B: seconds}`: one TriForce retrieval-cache build keeping B of the L tokens, and
`target.engine_overhead_seconds: {n: seconds}`: the decoding engine's time per step outside the target's
forward for a draft tree of n nodes (at the context `target.engine_overhead_context`). Profiled with
`--window-prefill`, the draft's section (the target's where there is no draft) gives `window_prefill: {sinks,
window, seconds}`: a StreamingLLM drafter's prefill of its window, paid once per prompt. `draft.prefill_seconds:
{L: seconds}` (with a draft, and `plan profile --engine llama.cpp`): the draft's prefill of a prompt of L tokens, which
a draft-model engine pays once per prompt before its first draft; `target.prefill_seconds` (with `--batches`): the
target's, which every request pays once as it joins a running batch (the serving price, planner/serving.py).

Profiled with `--batches`, a context's entry also gives `batches: {B: {t_seconds: {n: seconds}}}` (the target's
step of B sequences of n new tokens each, every sequence over its own cache of L tokens: t(B, n)) and the draft's
`batches: {B: {step_seconds: seconds}}` (its one-token step of B sequences), and the target's
`engine_overhead_batches: {B: {n: seconds}}`: the continuous-batching engine's time per step outside the forward for B
sequences of n-node trees (after short prompts: the host's work does not depend on the context). A profile without
them is B = 1.

`plan profile --engine llama-server --draft` also gives, per context, the draft's `chains: {B: {k: seconds}}`: the
draft model's work in llama-server's step drafting k tokens for each of B sequences (its k batched decodes and its
re-decoding of the k + 1 rows the target verified), what the server's step costs beyond the target's t(B, k + 1).
Its `settings.environment: {LLAMA_ARG_NAME: value}` holds the options llama-server took from its environment while
timed (`LLAMA_ARG_REPACK: 'false'`), which a plan solved on it records and its export starts llama-server with.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specplan.core.choices import FORWARDS, PROFILE_DTYPES, TIMED_FORWARDS
from specplan.core.errors import UserError
from specplan.core.fileio import check_plain_values, plain, read_yaml, shown, write_yaml
from specplan.core.machine import machine_identity
from specplan.core.validate import MAX_FORWARD_TOKENS, MAX_SECONDS, Fields


class LatencyCurve:
    """t(n) from measured points, interpolated monotonically (PCHIP) between them; no extrapolation."""

    def __init__(self, t_seconds: dict[int, float]) -> None:
        from scipy.interpolate import PchipInterpolator  # scipy takes seconds to import: not for every CLI command

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
    prompt_prefills: dict[str, dict[int, float]] = field(default_factory=dict)  # {role: {prompt tokens: seconds}}
    overhead_context: int | None = None  # the context engine_overhead_seconds was timed at
    target_batches: dict[int, dict[int, dict[int, float]]] = field(default_factory=dict)  # {L: {B: {n: s}}}
    draft_batches: dict[int, dict[int, float]] = field(default_factory=dict)  # {L: {B: one-token step s}}
    draft_chains: dict[int, dict[int, dict[int, float]]] = field(default_factory=dict)  # {L: {B: {k: s}}}
    overhead_batches: dict[int, dict[int, float]] = field(default_factory=dict)  # {B: {n: engine seconds per step}}
    unfit_batches: dict[int, set[int]] = field(default_factory=dict)  # {L: the modeled B whose caches do not fit}
    models: dict[str, str] = field(default_factory=dict)  # {role: model name}
    backend: str = "lean"  # the forward timed (profiles from before the transformers backend timed the lean one)
    dtype: str | None = None
    draft_dtype: str | None = None
    hardware: dict[str, Any] = field(default_factory=dict)
    measurement_seconds: float | None = None
    # the engine's options its environment set (a llama-server's LLAMA_ARG_ variables): part of what was timed
    engine_environment: dict[str, str] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> LatencyProfile:
        f = Fields(data, where)
        f.kind("profile/latency")
        target = f.sub("target")
        t_seconds = target.int_keyed_numbers("t_seconds", seconds=True, max_key=MAX_FORWARD_TOKENS)
        if 1 not in t_seconds:
            raise target.fail("'t_seconds' must include n = 1 (speedups are relative to t(1))")
        by_context: dict[int, dict[int, float]] = {}
        builds: dict[int, dict[int, float]] = {}
        target_batches: dict[int, dict[int, dict[int, float]]] = {}
        unfit_batches: dict[int, set[int]] = {}
        if target.has("contexts"):
            for context, entry in target.by_token_count("contexts").items():
                by_context[context] = entry.int_keyed_numbers("t_seconds", seconds=True, max_key=MAX_FORWARD_TOKENS)
                if 1 not in by_context[context]:
                    raise entry.fail("'t_seconds' must include n = 1 (speedups are relative to t(1))")
                if entry.has("retrieval_build_seconds"):
                    builds[context] = entry.int_keyed_numbers("retrieval_build_seconds", seconds=True)
                if entry.has("batches"):
                    batches = entry.by_token_count("batches")
                    target_batches[context] = {
                        B: batch.int_keyed_numbers("t_seconds", seconds=True, max_key=MAX_FORWARD_TOKENS)
                        for B, batch in batches.items()}
                    unfit_batches[context] = {B for B, batch in batches.items()
                                              if not batch.boolean("fits_memory", default=True)}
        draft = f.sub("draft", required=False)
        draft_step = draft.seconds("step_seconds", required=False) if draft else None
        draft_by_context: dict[int, float] = {}
        draft_batches: dict[int, dict[int, float]] = {}
        draft_chains: dict[int, dict[int, dict[int, float]]] = {}
        if draft is not None and draft.has("contexts"):
            for context, entry in draft.by_token_count("contexts").items():
                draft_by_context[context] = entry.seconds("step_seconds")
                if entry.has("batches"):
                    draft_batches[context] = {B: batch.seconds("step_seconds")
                                              for B, batch in entry.by_token_count("batches").items()}
                if entry.has("chains"):
                    draft_chains[context] = entry.by_token_count_numbers("chains", low=0.0, high=MAX_SECONDS,
                                                                         max_key=MAX_FORWARD_TOKENS)
        window_prefills = {}
        for role, section in (("target", target), ("draft", draft)):
            if section is not None and section.has("window_prefill"):
                prefill = section.sub("window_prefill")
                window_prefills[role] = (prefill.token_count("sinks", low=0), prefill.token_count("window"),
                                         prefill.seconds("seconds"))
        source = f.string("source", required=False, default="measured")
        if source not in ("measured", "modeled"):
            raise f.fail(f"'source' must be measured or modeled, got {shown(source)}")
        return cls(
            target_t_seconds=t_seconds,
            draft_step_seconds=draft_step,
            target_context=target.token_count("context", required=False),
            target_by_context=by_context,
            draft_by_context=draft_by_context,
            source=source,
            draft_vocab=f.integer("draft_vocab", required=False, low=1),
            builds_by_context={L: points for L, points in builds.items() if points},
            overhead_seconds=target.int_keyed_numbers("engine_overhead_seconds", low=0.0, high=MAX_SECONDS,
                                                                    max_key=MAX_FORWARD_TOKENS)
            if target.has("engine_overhead_seconds") else {},
            window_prefills=window_prefills,
            prompt_prefills={role: section.int_keyed_numbers("prefill_seconds", seconds=True)
                             for role, section in (("target", target), ("draft", draft))
                             if section is not None and section.has("prefill_seconds")},
            overhead_context=target.token_count("engine_overhead_context", required=False),
            target_batches=target_batches,
            draft_batches=draft_batches,
            draft_chains=draft_chains,
            unfit_batches={L: unfit for L, unfit in unfit_batches.items() if unfit},
            overhead_batches=target.by_token_count_numbers("engine_overhead_batches", low=0.0, high=MAX_SECONDS,
                                                           max_key=MAX_FORWARD_TOKENS)
            if target.has("engine_overhead_batches") else {},
            models=_names(f.sub("models", required=False)),
            backend=f.string("backend", required=False, default="lean", choices=TIMED_FORWARDS),
            dtype=f.string("dtype", required=False, choices=PROFILE_DTYPES),
            draft_dtype=f.string("draft_dtype", required=False, choices=PROFILE_DTYPES),
            hardware=_hardware(f.sub("hardware", required=False)),
            measurement_seconds=f.number("measurement_seconds", required=False, low=0.0),
            engine_environment=_environment(f.sub("settings", required=False)),
            raw=data,
        )

    def target_curve(self, context: int | None = None) -> LatencyCurve:
        if context is None or context == self.target_context:
            return LatencyCurve(self.target_t_seconds)
        if context not in self.target_by_context:
            known = sorted(self.target_by_context)
            raise UserError(f"the profile has no context {context} (it has {known})")
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

    @property
    def every_size_up_to(self) -> int:
        """The largest N such that the target's forward of one sequence was timed at every n <= N at every profiled
        context (`plan profile --row-totals N`; 2 for the sizes 1, 2, 4, ...)."""
        by_context = self.target_by_context or {self.target_context or 0: self.target_t_seconds}
        largest = 0
        while all(largest + 1 in points for points in by_context.values()):
            largest += 1
        return largest

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes B the target's step was profiled at (1: every profile)."""
        return sorted({1} | {B for batches in self.target_batches.values() for B in batches})

    def batch_latency(self, batch: int, n: int, contexts: float | list[float]) -> float:
        """t(B, n): one step of `batch` sequences of n new tokens each. `contexts`: every sequence's context (a
        step of sequences at different contexts costs the projections of all its rows plus each sequence's
        attention over its own keys: linear in each context, so priced at their mean), or one for all. Linear in
        B between profiled batch sizes and in the context between profiled contexts (clamped); PCHIP in n."""
        context = float(np.mean(contexts))
        if batch == 1:
            return float(self.latency(n, context))
        if not self.target_batches:
            raise UserError("the profile has no batched steps (profile with --batches)")
        largest = max(B for batches in self.target_batches.values() for B in batches)
        if not 1 <= batch <= largest:
            raise UserError(f"the profile's batched steps reach B = {largest}, not {batch}")
        at_context = {L: self._batch_at(L, batch, n) for L in self.target_batches}
        return _linear(at_context, context)

    def _batch_at(self, context: int, batch: int, n: int) -> float:
        curves = {1: LatencyCurve(self.target_by_context.get(context) or self.target_t_seconds)}
        curves.update({B: LatencyCurve(points) for B, points in self.target_batches[context].items()
                       if n <= max(points)})
        sizes = sorted(curves)
        if batch > sizes[-1]:
            raise UserError(f"the profile's batched steps at context {context} reach B = {sizes[-1]} for n = {n}")
        upper = next(B for B in sizes if B >= batch)
        lower = max(B for B in sizes if B <= batch)
        if upper == lower:
            return float(curves[upper](n))
        weight = (batch - lower) / (upper - lower)
        return float((1 - weight) * curves[lower](n) + weight * curves[upper](n))

    def largest_fitting_batch(self, context: float) -> int | None:
        """The largest profiled batch size whose KV caches fit the (modeled) device's memory at `context`, judged at
        the nearest profiled context at or above it; None where every profiled batch size fits."""
        if not self.unfit_batches:
            return None
        above = [L for L in sorted(self.target_batches) if L >= context] or [max(self.target_batches)]
        unfit = self.unfit_batches.get(above[0], set())
        if not unfit:
            return None
        return max([1] + [B for B in self.target_batches[above[0]] if B < min(unfit)])

    def draft_batch_step(self, batch: int, context: float | None = None) -> float | None:
        """The draft's one-token step of `batch` sequences (linear in B and the context; None unless profiled)."""
        if batch == 1:
            return self.draft_step(context)
        if not self.draft_batches:
            return None
        at_context = {}
        for L, steps in self.draft_batches.items():
            points = {1: self.draft_step(L), **steps}
            if batch <= max(points):
                at_context[L] = _linear(points, batch)
        return _linear(at_context, context if context is not None else min(at_context)) if at_context else None

    def draft_chain_seconds(self, batch: int, decodes: float, context: float | None = None) -> float | None:
        """The draft's work in a step where each of `batch` sequences made `decodes` draft decodes: the engine's
        measured work (`chains`: at each batch size its least-squares line over the decodes, each point being the
        difference of two measured medians; then linear in the batch size and the context, clamped), else that
        many one-token steps of the batch (draft_batch_step); None unless profiled."""
        if not self.draft_chains:
            step = self.draft_batch_step(batch, context)
            return None if step is None else decodes * step
        at_context = {L: _linear({B: max(fixed + slope * decodes, 0.0) for B, (fixed, slope) in lines.items()}, batch)
                      for L, lines in self._draft_chain_lines.items()}
        return _linear(at_context, context if context is not None else min(at_context))

    @functools.cached_property
    def _draft_chain_lines(self) -> dict[int, dict[int, tuple[float, float]]]:
        """{L: {B: (intercept, slope)}} of the measured draft work, fitted once: the replays price every step."""
        return {L: {B: least_squares_line(points) for B, points in by_batch.items() if points}
                for L, by_batch in self.draft_chains.items()}

    def retrieval_build(self, context: float, budget: int) -> float | None:
        """Seconds per retrieval-cache build keeping `budget` of `context` tokens: linear in the budget at each
        profiled context that has builds, then in the context (both clamped); None if none was timed."""
        if not self.builds_by_context:
            return None
        at_context = {L: _linear(points, budget) for L, points in self.builds_by_context.items()}
        return _linear(at_context, context)

    def engine_overhead(self, n: int | np.ndarray, batch: int = 1) -> np.ndarray:
        """The engine's seconds per step outside the target's forward for `batch` sequences of trees of n nodes:
        linear between the profiled sizes (clamped), then between the profiled batch sizes (B = 1: the one-request
        engine's; beyond the largest profiled B, proportional to B); 0 for a profile that has none (modeled, or
        older)."""
        if not self.overhead_seconds:
            return np.zeros_like(np.asarray(n, dtype=np.float64))
        by_batch = {1: self.overhead_seconds, **self.overhead_batches}

        def at(B: int) -> np.ndarray:
            sizes = sorted(by_batch[B])
            return np.interp(np.asarray(n, dtype=np.float64), sizes, [by_batch[B][k] for k in sizes])

        profiled = sorted(by_batch)
        if batch in by_batch:
            return at(batch)
        if batch > profiled[-1]:
            return at(profiled[-1]) * (batch / profiled[-1])
        upper = next(B for B in profiled if B > batch)
        lower = max(B for B in profiled if B < batch)
        weight = (batch - lower) / (upper - lower)
        return (1 - weight) * at(lower) + weight * at(upper)

    def step_seconds(self, n: int | np.ndarray, context: int | None = None) -> np.ndarray:
        """One decoding step's price for n tokens: t(n) on the curve of `context` (the base one by default) plus the
        engine's work around the forward, o(n)."""
        return self.target_curve(context)(n) + self.engine_overhead(n)

    def draft_step(self, context: float | None = None) -> float | None:
        """The draft's one-token step over `context` cached tokens: linear between its profiled contexts
        (clamped); the base context's step where no context is given or the profile lists none."""
        if context is None or not self.draft_by_context:
            return self.draft_step_seconds
        return _linear(self.draft_by_context, context)

    def prompt_prefill(self, role: str, prompt_tokens: int) -> float | None:
        """The `role` model's (target or draft) prefill of a prompt of `prompt_tokens`: its profiled seconds per
        token, linear between the profiled lengths (clamped), times the length; None unless profiled."""
        profiled = self.prompt_prefills.get(role)
        if not profiled:
            return None
        per_token = {length: seconds / length for length, seconds in profiled.items()}
        return _linear(per_token, prompt_tokens) * prompt_tokens

    def draft_prefill(self, prompt_tokens: int) -> float | None:
        """The draft's prefill of a prompt of `prompt_tokens` (prompt_prefill)."""
        return self.prompt_prefill("draft", prompt_tokens)

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
        return machine_identity(self.hardware)

    def plan_inputs(self, path: str | os.PathLike) -> dict[str, Any]:
        """What a plan records of the profile it was solved with (an export runs the engine as it was timed)."""
        return {"file": str(path), "source": self.source, "machine": self.machine,
                **({"environment": dict(self.engine_environment)} if self.engine_environment else {})}


def is_llama_server_environment(environment: Any) -> bool:
    """Whether `environment` maps LLAMA_ARG_ names to strings: options llama-server takes from its environment."""
    return isinstance(environment, dict) and all(
        isinstance(name, str) and name.startswith("LLAMA_ARG_") and isinstance(value, str)
        for name, value in environment.items())


def _environment(settings: Fields | None) -> dict[str, str]:
    """`settings.environment: {LLAMA_ARG_NAME: value}`, the options llama-server took from its environment."""
    if settings is None or not settings.has("environment"):
        return {}
    environment = settings.data["environment"]
    if not is_llama_server_environment(environment):
        raise settings.fail("'environment' must map LLAMA_ARG_ names to strings (the options llama-server took "
                            "from its environment)")
    return dict(environment)


def _names(models: Fields | None) -> dict[str, str]:
    """`models: {target: name, draft: name}`."""
    if models is None:
        return {}
    return {role: models.string(role) for role in models.data}


HARDWARE_STRINGS = ("device", "gpu", "cpu")


def _hardware(hardware: Fields | None) -> dict[str, Any]:
    """`hardware`, free-form but for the fields a machine's identity is read from (core.machine)."""
    if hardware is None:
        return {}
    for key in HARDWARE_STRINGS:
        hardware.string(key, required=False)
    hardware.integer("threads", required=False, low=1)
    flags = hardware.data.get("cpu_flags")
    if flags is not None and not (isinstance(flags, list) and all(isinstance(x, str) for x in flags)):
        raise hardware.fail("'cpu_flags' must be a list of names")
    return hardware.data


def covering(keys: Iterable[int], low: float, high: float) -> list[int]:
    """The keys whose values a clamped linear interpolation reads anywhere in [low, high]."""
    ordered = sorted(keys)
    first = max([k for k in ordered if k <= low], default=ordered[0])
    last = min([k for k in ordered if k >= high], default=ordered[-1])
    return [k for k in ordered if first <= k <= last]


def least_squares_line(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points; through the origin for one point."""
    xs = np.array(sorted(points), dtype=np.float64)
    ys = np.array([points[x] for x in sorted(points)])
    if len(xs) == 1:
        return 0.0, float(ys[0] / xs[0])
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(intercept), float(slope)


def _linear(points: dict[int, float], x: float) -> float:
    """The value at x, linear between the points' keys and clamped outside them."""
    keys = sorted(points)
    return float(np.interp(x, keys, [points[k] for k in keys]))


def load_profile(path: str | os.PathLike, backends: tuple[str, ...] = FORWARDS) -> LatencyProfile:
    """A profile that times one of `backends`: by default our own forwards, which our decoder's plans are priced
    on; a llama.cpp profile prices llama.cpp's own decoding only (`plan solve lookahead --engine llama.cpp`)."""
    profile = LatencyProfile.from_dict(read_yaml(path), str(path))
    if profile.backend not in backends:
        how = "plan profile --engine llama.cpp" if backends == ("llama.cpp",) else "plan profile"
        raise UserError(f"{path} times the {profile.backend} forward; this plan is priced on a profile of "
                        f"{' or '.join(backends)} ({how})")
    return profile


def save_profile(document: dict[str, Any], path: str | os.PathLike) -> LatencyProfile:
    """Write a profile the profiler assembled, after reading it back with the loader: what is written loads."""
    profile = LatencyProfile.from_dict(plain(document), str(path))
    check_plain_values(profile.raw, str(path))
    write_yaml(path, profile.raw)
    return profile
