"""Re-pricing a TriForce plan: the profile points its prediction reads, and its setting priced again with another
profile (re-timed by `plan bench --reprice`) exactly as the solver priced it."""

from __future__ import annotations

from dataclasses import dataclass

from specplan.core.acceptance_schema import StreamingRecord, TriForceEntry, load_triforce_acceptance
from specplan.core.errors import UserError
from specplan.core.plan_schema import Plan
from specplan.core.profile_schema import LatencyProfile, covering
from specplan.core.provenance import check_unchanged
from specplan.planner.triforce_cost import (
    TriForceCandidate,
    bottom_draft_seconds,
    evaluate,
    evaluate_streaming,
    evaluate_traces,
    largest_profiled_n,
    streaming_seconds,
    window_prefill_seconds,
)


@dataclass(frozen=True)
class PricedPoints:
    """The profile points a plan's prediction (and its best two-level setting's) reads: target sizes per
    context, build budgets per context, draft contexts. Re-timing exactly these re-prices the prediction as
    the solver priced it, interpolation included."""

    target: dict[int, list[int]]
    builds: dict[int, list[int]]
    draft: list[int]
    window_prefill: str | None = None  # the role (draft or target) whose profiled window prefill is priced


def _plan_settings(plan: Plan) -> list[tuple[TriForceEntry | StreamingRecord, int, int, float | None]]:
    """(acceptance entry, gamma1, gamma2, bottom seconds) for the plan's setting, then its best two-level one."""
    path = plan.inputs["acceptance"]["file"]
    check_unchanged(plan.provenance, path, "the plan's acceptance file")
    acceptance = load_triforce_acceptance(path)
    s = plan.settings

    def entry(budget: int, chunk: int, stride: int) -> TriForceEntry:
        found = next((e for e in acceptance.entries if (e.context, e.budget, e.chunk, e.stride)
                      == (s.context, budget, chunk, stride)), None)
        if found is None:
            raise UserError(f"{path} has no entry for context {s.context}, "
                            f"budget {budget}, chunk {chunk}, stride {stride}: not the plan's acceptance file")
        return found

    two = plan.prediction.details.get("best_two_level") or s.to_dict()
    two_level = (entry(two["budget"], two["chunk"], two["stride"]), 0, two["gamma2"], None)
    if s.bottom == "streaming":
        record = acceptance.streaming_at(s.context)
        if record is None:
            raise UserError(f"{path} has no streaming draft measured at context {s.context}: "
                            "not the plan's acceptance file")
        return [(record, 0, s.gamma2, None), two_level]
    plan_bottom = None if s.bottom == "none" else plan.inputs.get("bottom_seconds_per_draft")
    return [(entry(s.budget, s.chunk, s.stride), 0 if plan_bottom is None else s.gamma1,
             s.gamma2, plan_bottom), two_level]


def priced_points(plan: Plan, profile: LatencyProfile) -> PricedPoints:
    context = plan.settings.context
    contexts = sorted(profile.target_by_context)
    if not contexts:
        raise UserError("re-pricing needs a profile timed at several contexts")
    target: dict[int, int] = {}  # context -> the largest size read there
    builds: dict[int, set[int]] = {}
    streaming_cache = plan.settings.sinks + plan.settings.window
    draft_priced = plan.settings.bottom == "model"
    settings = _plan_settings(plan)
    for entry, gamma1, gamma2, _ in settings:
        if isinstance(entry, StreamingRecord):  # the streaming draft's record: the top's chains, the drafter's step
            longest = max(len(trace) for trace in entry.traces)
            draft_priced = entry.drafter == "draft"
            if not draft_priced:
                for L in covering(contexts, streaming_cache, streaming_cache):
                    target[L] = max(target.get(L, 1), 1)
        else:
            longest = max((len(trace.middle) for trace in entry.traces), default=1)
            middle = entry.budget + entry.chunk
            for L in covering(contexts, middle, middle):
                target[L] = max(target.get(L, 1), gamma1 + 1)
            for L in covering(profile.builds_by_context, context, context) if profile.builds_by_context else []:
                builds.setdefault(L, set()).update(covering(profile.builds_by_context[L], entry.budget,
                                                            entry.budget))
        for L in covering(contexts, context, context + longest - 1):
            longest_chain = min(gamma2 + gamma1 + 2, largest_profiled_n(profile))  # the longest chain + 1
            target[L] = max(target.get(L, 1), longest_chain)
    draft = []
    if draft_priced and profile.draft_by_context:
        draft = covering(profile.draft_by_context, streaming_cache, streaming_cache)
    prefill_role = _window_prefill_role(settings[0][0], settings[0][1], plan.settings.bottom)
    if prefill_role and profile.window_prefill(prefill_role, plan.settings.sinks, plan.settings.window) is None:
        prefill_role = None
    return PricedPoints({L: profile.target_curve(L).support(largest) for L, largest in sorted(target.items())},
                        {L: sorted(budgets) for L, budgets in sorted(builds.items())}, draft, prefill_role)


def _window_prefill_role(entry: TriForceEntry | StreamingRecord, gamma1: int, bottom: str) -> str | None:
    """The model whose StreamingLLM window prefill a plan's setting (`_plan_settings`) charges: a streaming
    draft's drafter, or the draft under a model bottom; None for a trie bottom or the two-level variant."""
    if isinstance(entry, StreamingRecord):
        return entry.drafter
    return "draft" if gamma1 and bottom == "model" else None


def reprice(plan: Plan, profile: LatencyProfile) -> tuple[TriForceCandidate, TriForceCandidate]:
    """The plan's setting and its best two-level setting, priced with `profile` exactly as the solver priced
    them (the trace replay, or the closed form where the acceptance has no traces)."""
    (entry, gamma1, gamma2, bottom_seconds), two_level = _plan_settings(plan)
    context, sinks, window = plan.settings.context, plan.settings.sinks, plan.settings.window
    priced_two = evaluate_traces(profile, context, *two_level, {}) if two_level[0].traces else \
        evaluate(profile, context, *two_level)
    role = _window_prefill_role(entry, gamma1, plan.settings.bottom)
    prefill = window_prefill_seconds(profile, role, sinks, window) if role else 0.0
    if isinstance(entry, StreamingRecord):
        return evaluate_streaming(profile, context, entry, gamma2, streaming_seconds(profile, entry, sinks + window),
                                  {}, priced_two, prefill), priced_two
    if role:
        bottom_seconds = bottom_draft_seconds("model", profile, sinks + window)
    priced = evaluate_traces(profile, context, entry, gamma1, gamma2, bottom_seconds, {}, prefill) \
        if entry.traces else evaluate(profile, context, entry, gamma1, gamma2, bottom_seconds)
    return priced, priced_two
