"""TriForce's plan: the setting (gamma1, gamma2, budget, chunk, stride, bottom level) with the least expected time
per token under the cost model of planner/triforce_cost.py, searched over the acceptance file's measured
settings at the plan's context."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from specplan.core.acceptance_schema import (
    TRIFORCE_DECODED_SETTINGS,
    StreamingRecord,
    TriForceAcceptance,
    TriForceEntry,
    load_triforce_acceptance,
)
from specplan.core.choices import MIN_SPEEDUP
from specplan.core.errors import UserError
from specplan.core.fileio import shown
from specplan.core.method_settings import STREAMING_SINKS, STREAMING_WINDOW, TriForceSettings
from specplan.core.model_names import same_model
from specplan.core.plan_schema import BatchSchedule, Plan, PlanModels, Prediction
from specplan.core.profile_schema import LatencyProfile, load_profile
from specplan.core.provenance import provenance
from specplan.planner.closed_loop import SettingPrice, schedule_table
from specplan.planner.triforce_cost import (
    GAMMA1,
    GAMMA2,
    TriForceCandidate,
    bottom_draft_seconds,
    evaluate,
    evaluate_streaming,
    evaluate_traces,
    setting_price,
    streaming_seconds,
    window_prefill_seconds,
)

REPLAY_SWITCH_MARGIN = 0.02


def _decoded_settings(candidate: TriForceCandidate, bottom: str) -> dict[str, int | str]:
    """The plan settings a candidate decodes with: those an acceptance file's `decoded_with` records."""
    values = {"bottom": "streaming" if candidate.streaming else "none" if candidate.gamma1 == 0 else bottom,
              "gamma1": max(candidate.gamma1, 1),
              "gamma2": candidate.gamma2, "budget": candidate.budget, "chunk": candidate.chunk,
              "stride": candidate.stride}
    return {key: values[key] for key in TRIFORCE_DECODED_SETTINGS}


def solve_triforce(acceptance_path: str | Path, profile_path: str | Path, context: int | None = None,
                   bottom_seconds: float | None = None, two_level: bool = False,
                   rebuild_below: float = 0.0, min_speedup: float = MIN_SPEEDUP, largest_batch: int | None = None
                   ) -> tuple[Plan, list[TriForceCandidate]]:
    """The plan at `context`; with `largest_batch`, its schedule up to that batch size (`triforce_schedule`)."""
    if not math.isfinite(min_speedup) or min_speedup <= 0:
        raise UserError(f"the minimum speedup must be a positive number, got {min_speedup}")
    acceptance = load_triforce_acceptance(acceptance_path)
    profile = load_profile(profile_path)
    contexts = sorted({e.context for e in acceptance.entries})
    context = context or contexts[-1]
    entries = [e for e in acceptance.entries if e.context == context]
    if not entries:
        raise UserError(f"{acceptance_path} has no measurements at context {context} (it has {contexts})")
    measured = profile.models.get("target")
    if measured and not same_model(measured, acceptance.target):
        raise UserError(f"{acceptance_path} and {profile_path}: the acceptance is for {shown(acceptance.target)} but "
                        f"the profile for {shown(measured)}")
    bottom = "none" if two_level else ("trie" if acceptance.bottom == "trie" else "model")
    sinks, window = acceptance.bottom_cache or (STREAMING_SINKS, STREAMING_WINDOW)
    if bottom_seconds is None and bottom != "none":
        bottom_seconds = bottom_draft_seconds(bottom, profile, sinks + window)
    started = time.perf_counter()
    record = None if two_level else acceptance.streaming_at(context)
    search = _search(profile, context, entries, bottom, bottom_seconds, record, sinks, window)
    best, exact = _choose(search.candidates, acceptance.decoded_with, bottom)
    speculate = bool(best.speedup > min_speedup)
    settings = TriForceSettings(**_decoded_settings(best, bottom), context=context, rebuild_below=rebuild_below,
                                sinks=sinks, window=window, speculate=speculate).check()
    plan = _assemble(settings, best, exact, search, record, acceptance, acceptance_path, profile, profile_path,
                     bottom_seconds, min_speedup)
    if largest_batch is not None:
        plan.schedule, rates = triforce_schedule(plan, entries, profile, largest_batch, bottom_seconds, min_speedup)
        plan.solver["schedule"] = {"algorithm": "the most output tokens/s over the batch at every batch size, each "
                                                "chain length gamma2 replayed over the traces at the plan's levels",
                                   "min_speedup": min_speedup, "tokens_per_second": rates}
    plan.solver["seconds"] = time.perf_counter() - started
    return plan, search.candidates


def triforce_schedule(plan: Plan, entries: list[TriForceEntry], profile: LatencyProfile, largest_batch: int,
                      bottom_seconds: float | None, min_speedup: float = MIN_SPEEDUP
                      ) -> tuple[BatchSchedule, dict[str, list[float | None]]]:
    """The chain length per batch size: at each B, gamma2 = 1..the plan's (its bottom, gamma1 and retrieval cache
    kept) or none, whichever gives the most output tokens/s over the batch (planner/closed_loop.py: schedule_table,
    each setting's price from triforce_cost.setting_price), at the plan's context plus half a continuation. Where the
    acceptance was decoded with the plan's own chain, its replay is exact and the others' approximate: another chain
    length replaces it at a batch size only where priced REPLAY_SWITCH_MARGIN faster, as in the plan's own choice
    (docs/design.md)."""
    if not profile.target_batches:
        raise UserError("a schedule per batch size needs a profile with --batches (t(B, n))")
    largest_nodes = plan.largest_setting
    if largest_nodes is None:
        raise UserError("--batches schedules a hierarchy's chain length: this plan " + (
            "drafts at no batch size" if not plan.settings.speculate else "has no middle level (streaming)"))
    entry = _planned_entry(plan.settings, entries)
    prices = _setting_prices(plan.settings, entry, profile, bottom_seconds, set(range(2, largest_nodes + 1)))
    context = int(round(plan.settings.context + np.mean([len(t.middle) for t in entry.traces]) / 2))
    largest = min(largest_batch, max(profile.batch_sizes), profile.largest_fitting_batch(context) or largest_batch)
    exact = (largest_nodes, REPLAY_SWITCH_MARGIN) if plan.prediction.replay_exact else None
    return schedule_table(prices, profile, largest, context, "triforce", min_speedup, exact=exact)


def plan_setting_prices(plan: Plan, nodes: set[int]) -> dict[int, SettingPrice]:
    """Each of `nodes` (gamma2 + 1: the plan's schedule's, fixed settings') priced at the plan's levels, replayed
    over the acceptance file and on the profile the plan was solved on."""
    entries = [e for e in load_triforce_acceptance(plan.inputs["acceptance"]["file"]).entries
               if e.context == plan.settings.context]
    profile = load_profile(plan.inputs["profile"]["file"])
    return _setting_prices(plan.settings, _planned_entry(plan.settings, entries), profile,
                           plan.inputs.get("bottom_seconds_per_draft"), nodes)


def _planned_entry(settings: TriForceSettings, entries: list[TriForceEntry]) -> TriForceEntry:
    """The acceptance measured at the plan's retrieval cache, with the traces a batch's price replays."""
    entry = next((e for e in entries if (e.budget, e.chunk, e.stride) == (settings.budget, settings.chunk,
                                                                           settings.stride)), None)
    if entry is None or not entry.traces:
        raise UserError("a TriForce schedule replays the acceptance's per-prompt traces at the plan's budget, chunk "
                        "and stride: measure them with `plan accept triforce`, which keeps them")
    return entry


def _setting_prices(settings: TriForceSettings, entry: TriForceEntry, profile: LatencyProfile,
                    bottom_seconds: float | None, nodes: set[int]) -> dict[int, SettingPrice]:
    drafted = None if settings.bottom == "none" else bottom_seconds
    prefill = window_prefill_seconds(profile, "draft", settings.sinks, settings.window) \
        if settings.bottom == "model" else 0.0
    return {n: setting_price(profile, settings.context, entry, settings.gamma1, n - 1, settings.bottom, drafted,
                             settings.sinks + settings.window, prefill) for n in sorted(nodes) if n >= 2}


@dataclass
class _Search:
    candidates: list[TriForceCandidate]  # fastest first
    best_two_level: TriForceCandidate
    replayed: bool  # priced by replaying traces (else the closed form)
    streaming_draft_seconds: float | None  # c_s, where a streaming draft was searched


def _search(profile: LatencyProfile, context: int, entries: list[TriForceEntry], bottom: str,
            bottom_seconds: float | None, record: StreamingRecord | None, sinks: int, window: int) -> _Search:
    """Every setting priced: each measured (budget, chunk, stride) with the two-level variant and each gamma1 of
    the bottom, each gamma2; then the streaming draft at each gamma, if the acceptance file measured it."""
    def fastest_first(c: TriForceCandidate) -> tuple:
        return -c.speedup, c.gamma2, c.gamma1, c.budget

    candidates = []
    top_costs: dict[int, np.ndarray] = {}
    replayed = all(entry.traces for entry in entries)
    bottom_prefill = window_prefill_seconds(profile, "draft", sinks, window) if bottom == "model" else 0.0
    searched = [(0, None)] + ([] if bottom == "none" else [(gamma1, bottom_seconds) for gamma1 in GAMMA1])
    for entry in entries:
        for gamma1, drafted in searched:
            for gamma2 in GAMMA2:
                if gamma2 < gamma1:
                    continue
                candidates.append(evaluate_traces(profile, context, entry, gamma1, gamma2, drafted, top_costs,
                                                  bottom_prefill)
                                  if replayed else evaluate(profile, context, entry, gamma1, gamma2, drafted))
    candidates.sort(key=fastest_first)
    best_two_level = next(c for c in candidates if c.gamma1 == 0)
    streaming_draft = None
    if record is not None:
        streaming_draft = streaming_seconds(profile, record, sinks + window)
        streaming_prefill = window_prefill_seconds(profile, record.drafter, sinks, window)
        candidates += [evaluate_streaming(profile, context, record, gamma, streaming_draft, top_costs, best_two_level,
                                          streaming_prefill)
                       for gamma in GAMMA2]
        candidates.sort(key=fastest_first)
    return _Search(candidates, best_two_level, replayed, streaming_draft)


def _choose(candidates: list[TriForceCandidate], decoded_with: dict | None, bottom: str
            ) -> tuple[TriForceCandidate, TriForceCandidate | None]:
    """The fastest setting; but the one the acceptance file was decoded with (whose replay is exact) where it is
    within REPLAY_SWITCH_MARGIN of it. Returns (chosen, the decoded-with setting or None)."""
    exact = next((c for c in candidates if decoded_with and all(
        decoded_with.get(key) == value for key, value in _decoded_settings(c, bottom).items())), None)
    best = candidates[0]
    if exact is not None and best.speedup < exact.speedup * (1.0 + REPLAY_SWITCH_MARGIN):
        best = exact
    return best, exact


def _assemble(settings: TriForceSettings, best: TriForceCandidate, exact: TriForceCandidate | None,
              search: _Search, record: StreamingRecord | None, acceptance: TriForceAcceptance,
              acceptance_path: str | Path, profile: LatencyProfile, profile_path: str | Path,
              bottom_seconds: float | None, min_speedup: float) -> Plan:
    """The plan file: the settings, the prediction (and the baselines' best settings `plan bench` runs), inputs."""
    bottom, context, sinks, window = settings.bottom, settings.context, settings.sinks, settings.window
    # whose window prefill the plan's decoding pays (None in the plan: not profiled, so unpriced)
    streaming_role = record.drafter if bottom == "streaming" else "draft" if bottom == "model" else None
    has_draft = bottom == "model" or (bottom == "streaming" and record.drafter == "draft")
    models = PlanModels(target=acceptance.target, draft=acceptance.bottom if has_draft else None,
                        dtype=profile.dtype or None, backend=profile.backend)
    speculative = {"tokens_per_step": best.tokens_per_step, "speedup": best.speedup,
                   "seconds_per_token": best.seconds_per_token, "chain_tokens": best.chain_tokens,
                   "middle_acceptance": best.middle_acceptance, "bottom_acceptance": best.bottom_acceptance}
    if settings.speculate:
        prediction = Prediction(best.tokens_per_step, best.speedup, seconds_per_token=best.seconds_per_token,
                                details={k: speculative[k] for k in ("chain_tokens", "middle_acceptance",
                                                                     "bottom_acceptance")})
    else:
        prediction = Prediction(1.0, 1.0, seconds_per_token=best.seconds_per_token * best.speedup,
                                details={"best_speculative": speculative})
    two = search.best_two_level
    prediction = replace(prediction, latency_source=profile.source)
    prediction.details.update({
        "build_source": "measured" if profile.retrieval_build(context, best.budget) is not None
        else "t(1, L): the profile times no retrieval build",
        # `plan bench` runs its two-level baseline with these settings, the variant at its own best
        "best_two_level": {"gamma2": two.gamma2, "budget": two.budget, "chunk": two.chunk, "stride": two.stride,
                           "speedup": two.speedup, "tokens_per_step": two.tokens_per_step}})
    if record is not None:  # `plan bench` runs its streaming baseline with this gamma
        best_streaming = next(c for c in search.candidates if c.streaming)
        prediction.details["best_streaming"] = {"drafter": record.drafter, "gamma2": best_streaming.gamma2,
                                        "speedup": best_streaming.speedup,
                                        "tokens_per_step": best_streaming.tokens_per_step}
    if acceptance.decoded_with and settings.speculate:
        prediction = replace(prediction, replay_exact=best is exact)
    return Plan(
        method="triforce",
        models=models,
        prediction=prediction,
        inputs={"acceptance": {"file": str(acceptance_path)}, "profile": profile.plan_inputs(profile_path),
                "context": context, "bottom_seconds_per_draft": bottom_seconds,
                **({"streaming_seconds_per_draft": search.streaming_draft_seconds} if record is not None else {}),
                **({"window_prefill_seconds": profile.window_prefill(streaming_role, sinks, window)}
                   if streaming_role else {})},
        solver={"seconds": 0.0, "min_speedup": min_speedup,
                "algorithm": "expected time per token, " + ("replayed over the acceptance traces" if search.replayed
                                                            else "closed form") + " (planner/triforce_cost.py)",
                "top": [asdict(c) for c in search.candidates[:10]]},
        provenance=provenance([acceptance_path, profile_path]),
        sampling={"temperature": acceptance.temperature},
        settings=settings,
    )
