"""TriForce's gamma1, gamma2, budget, chunk size and rebuild stride, from an expected-time-per-token model.

Inputs at the plan's context L: a_m, the per-token acceptance of the middle level (target over a retrieval
cache of budget B, chunk s, stride R) against the full target; a_b, the bottom drafter's against the middle
level (both from `plan accept triforce`); t(n, L), the target's forward time (from `plan profile`, whose
contexts also cover the budgets: the middle level is the target at context about B + s); c_b, the bottom's
cost per drafted token (a draft model's t_d(1) over its StreamingLLM window, or the trie's retrieval time).
Where the profile measured it, every forward below also carries o(n), the decoding engine's time per step
outside the forward (mask, verification walk, commit): t(n, L) stands for t(n, L) + o(n) throughout.

With acceptance rate a, a chain of g drafts yields on average E(a, g) = (1 - a^(g+1)) / (1 - a) tokens
(the accepted prefix plus the corrected or bonus token). One top-level step:

- middle rounds: the bottom drafts gamma1 tokens (cost gamma1 * c_b), the middle verifies them in one forward
  (t(gamma1 + 1, B + s)) and yields E(a_b, gamma1) tokens; k = ceil(gamma2 / E(a_b, gamma1)) rounds collect a
  chain of n = k * E(a_b, gamma1) >= gamma2 tokens;
- the top verifies the chain (t(n + 1, L)) and keeps E(a_m, n) tokens;
- a retrieval-cache rebuild, b(L, B) seconds (`plan profile` times it; a profile without builds prices it
  at t(1, L)), every R' = min(R, B - s) tokens: the decoder rebuilds after R inserted tokens, or once the
  tokens written over the lowest-ranked slots would reach the sink chunk.

    time per token = [k * (gamma1 * c_b + t(gamma1 + 1, B + s)) + t(n + 1, L)] / E(a_m, n) + b(L, B) / R'
    predicted speedup = t(1, L) / time per token

The two-level variant (no bottom) has gamma1 = 0: each middle round is one forward t(1, B + s) yielding one
token. It is searched beside every bottom setting, and wins where the bottom's acceptance does not pay for the
middle's wider forwards: the plan then has no bottom (and records the best two-level setting either way).

The StreamingLLM-only draft (no middle: the draft model, or the target itself where the bottom is a trie, over
a cache of sinks + window tokens, drafts a chain of gamma2 tokens straight for the top) is searched too where
the acceptance file measured it (its `streaming` record, acceptance a_s against the full target): gamma2
drafts at c_s each, c_s = t_d(1, sinks + window) (or t(1, sinks + window) for the target), then the top's
t(gamma2 + 1, L), yielding E(a_s, gamma2); no retrieval cache, so no builds. It wins where the target's
weights, not its KV cache, dominate a step (a 1.5B target at 4K on a CPU): the plan then has `bottom:
streaming`, and records the best streaming setting either way.

A streaming drafter (this one, or a model bottom under the middle level) prefills its window of sinks +
window tokens once per prompt, when the engine resets it at the start of decoding: w seconds, from the
profile's `window_prefill` (`plan profile --window-prefill SINKS,WINDOW`), charged once per continuation in
the replay below. For the 0.5b over 1028 tokens on a 2-core CPU that is seconds per prompt, which decoding
wins back only after hundreds of tokens. A profile without it leaves w unpriced (0): the plan records
`window_prefill_seconds: null`.

Plain one-token decoding is the baseline every setting is priced against (speedup 1). Unless the best setting
is predicted faster than `min_speedup` times it, the plan decodes one token per step (`speculate: false`) and
records the best setting, which `plan bench` still runs its TriForce baselines with: on a machine whose
multi-token forwards cost nearly k times a one-token forward, no setting pays at a moderate context.

When the acceptance was measured decoding with a plan (`plan accept triforce --decode-with`), the replay is
exact for that plan's settings only: the middle level ran in that plan's steps. Another setting, replayed
approximately, replaces it only when predicted more than REPLAY_SWITCH_MARGIN (2%) faster, so that rounds of
decoding and solving settle instead of alternating between near-ties.

That closed form treats acceptances as independent per token, which real text is not: acceptance comes in
runs, and a needle answer ends after twenty tokens. When the acceptance file holds per-prompt traces (the
middle's and the bottom's acceptance at each position p of the target's own continuation, which ends at a
stop token), the planner replays them instead, backwards over the positions of each continuation:

    rounds(p), n(p): middle rounds from p, each yielding 1 + r(q) tokens from its start q, until the chain
                     holds n(p) >= gamma2 tokens; r(q) is the bottom's accepted run there: recorded per gamma1
                     for a trie at T = 0 (the decoder's trie drafts and the middle's greedy walk), else
                     sum_{j=1..gamma1} prod_{i<j} b[q + i];
    P_j(p)         = prod_{i<j} a[p + i] * (1 - a[p + j]) for j < n(p), prod_{i<n(p)} a[p + i] for j = n(p):
                     the probability that the top accepts exactly j of the chain (0/1 traces at T = 0);
    time(p)        = rounds(p) * (gamma1 * c_b + t(gamma1 + 1, B + s)) + t(n(p) + 1, L + p)
                     + sum_j P_j(p) * time(p + j + 1),   time(p) = 0 past the continuation's end,

and likewise the expected step count (the streaming draft: the same replay with gamma1 = 0 over its own
trace, each round one draft at c_s). Each continuation also pays its first build: the target's forward of the
last prompt token over the full cache, whose query scores the chunks (t(1, L)), and b(L, B); and a streaming
or model drafter's window prefill w. Then

    time per token = [sum of (time(0) + t(1, L) + b(L, B) + w + floor((N - 1) / R') b(L, B))] / sum of N,

over the continuations, of N tokens each (a rebuild falls due after the tokens of a step are inserted and
is built when the next step starts, so none follows the last token; the streaming draft has neither builds
nor t(1, L)). The autoregressive time is the sum of t(1, L + p) over the positions.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from numba import njit

from core.acceptance_schema import (
    TRIFORCE_DECODED_SETTINGS,
    TRIFORCE_GAMMA1,
    StreamingRecord,
    TriForceEntry,
    load_triforce_acceptance,
)
from core.errors import UserError
from core.fileio import shown
from core.method_settings import STREAMING_SINKS, STREAMING_WINDOW, TriForceSettings
from core.plan_schema import Plan
from core.profile_schema import LatencyProfile, covering, load_profile
from core.provenance import check_unchanged, provenance

GAMMA1 = TRIFORCE_GAMMA1
GAMMA2 = tuple(range(1, 17))
TRIE_SECONDS_PER_DRAFT = 2e-4  # one retrieval plus insertion (bench/trie.py measures it)
REPLAY_SWITCH_MARGIN = 0.02


def expected_tokens(acceptance: float, drafts: float) -> float:
    if acceptance >= 1.0:
        return drafts + 1.0
    return (1.0 - acceptance ** (drafts + 1.0)) / (1.0 - acceptance)


@dataclass(frozen=True)
class TriForceCandidate:
    gamma1: int
    gamma2: int
    budget: int
    chunk: int
    stride: int
    middle_acceptance: float
    bottom_acceptance: float
    chain_tokens: float
    tokens_per_step: float
    step_seconds: float
    seconds_per_token: float
    speedup: float
    streaming: bool = False  # the StreamingLLM-only draft (budget, chunk, stride: the best two-level setting's)


def evaluate(profile: LatencyProfile, context: int, entry: TriForceEntry, gamma1: int, gamma2: int,
             bottom_seconds: float | None) -> TriForceCandidate:
    """The model above for one setting; bottom_seconds None means no bottom (the two-level variant)."""
    if bottom_seconds is None:
        per_round, gamma1 = 1.0, 0
    else:
        per_round = expected_tokens(entry.bottom, gamma1)
    round_cost = _round_cost(profile, entry, gamma1, bottom_seconds)
    rounds = math.ceil(gamma2 / per_round)
    chain = rounds * per_round
    top = _forward_seconds(profile, min(chain + 1, _max_n(profile)), context)
    tokens = expected_tokens(entry.middle, chain)
    step = rounds * round_cost + top
    t1 = _forward_seconds(profile, 1, context)
    per_token = step / tokens + build_seconds(profile, context, entry.budget) / refill(entry)
    return TriForceCandidate(gamma1, gamma2, entry.budget, entry.chunk, entry.stride, entry.middle,
                             entry.bottom, chain, tokens, step, per_token, t1 / per_token)


def _forward_seconds(profile: LatencyProfile, n: float, context: float) -> float:
    """t(n, L) + o(n): a forward and the engine's work around it."""
    return float(profile.latency(n, context) + profile.engine_overhead(n))


def _round_cost(profile: LatencyProfile, entry: TriForceEntry, gamma1: int, bottom_seconds: float | None) -> float:
    """One middle round: gamma1 bottom drafts and the middle level's forward over its retrieval cache (one
    token, without a bottom)."""
    middle_context = entry.budget + entry.chunk
    if bottom_seconds is None:
        return _forward_seconds(profile, 1, middle_context)
    return gamma1 * bottom_seconds + _forward_seconds(profile, gamma1 + 1, middle_context)


def build_seconds(profile: LatencyProfile, context: int, budget: int) -> float:
    """b(L, B): one retrieval-cache build, as profiled, else priced at one forward's reading, t(1, L)."""
    measured = profile.retrieval_build(context, budget)
    return measured if measured is not None else float(profile.latency(1, context))


def refill(entry: TriForceEntry) -> int:
    """R': tokens inserted into the retrieval cache between two rebuilds."""
    return min(entry.stride, entry.budget - entry.chunk)


def evaluate_traces(profile: LatencyProfile, context: int, entry: TriForceEntry, gamma1: int, gamma2: int,
                    bottom_seconds: float | None, top_costs: dict[int, np.ndarray],
                    window_prefill: float = 0.0) -> TriForceCandidate:
    """The replay above for one setting; `top_costs[T]` is the t(n, L + p) table of `_top_costs`;
    `window_prefill` is w, a model bottom's per prompt."""
    if bottom_seconds is None:
        gamma1, window_prefill = 0, 0.0
    round_cost = _round_cost(profile, entry, gamma1, bottom_seconds)
    tokens = steps = seconds = ar_seconds = chains = 0.0
    for trace in entry.traces:
        length = len(trace.middle)
        if length not in top_costs:
            top_costs[length] = _top_costs(profile, context, length)
        table = top_costs[length]
        runs = trace.bottom_runs[gamma1 - 1] if trace.bottom_runs is not None and gamma1 else NO_RUNS
        trace_seconds, trace_steps, mean_chain = _replay_trace(trace.middle, trace.bottom, runs, gamma1,
                                                               gamma2, round_cost, table)
        tokens += length
        steps += trace_steps
        seconds += trace_seconds
        ar_seconds += table[1].sum()
        chains += mean_chain * length
    t1 = _forward_seconds(profile, 1, context)
    build = build_seconds(profile, context, entry.budget)
    rebuilds = sum((len(trace.middle) - 1) // refill(entry) for trace in entry.traces)
    per_token = (seconds + len(entry.traces) * (t1 + build + window_prefill) + rebuilds * build) / tokens
    return TriForceCandidate(gamma1, gamma2, entry.budget, entry.chunk, entry.stride, entry.middle,
                             entry.bottom, chains / tokens, tokens / steps, seconds / steps, per_token,
                             (ar_seconds / tokens) / per_token)


def evaluate_streaming(profile: LatencyProfile, context: int, record: StreamingRecord, gamma: int,
                       seconds_per_draft: float, top_costs: dict[int, np.ndarray], retrieval: TriForceCandidate,
                       window_prefill: float = 0.0) -> TriForceCandidate:
    """The StreamingLLM-only draft's replay (see the docstring), w = `window_prefill` per prompt; `retrieval`
    lends its budget, chunk and stride to the plan's settings, which a `bottom: streaming` plan keeps for its
    two-level baseline."""
    tokens = steps = seconds = ar_seconds = 0.0
    for trace in record.traces:
        length = len(trace)
        if length not in top_costs:
            top_costs[length] = _top_costs(profile, context, length)
        table = top_costs[length]
        trace_seconds, trace_steps, _ = _replay_trace(trace, np.ones(length), NO_RUNS, 0, gamma, seconds_per_draft,
                                                      table)
        tokens += length
        steps += trace_steps
        seconds += trace_seconds
        ar_seconds += table[1].sum()
    per_token = (seconds + len(record.traces) * window_prefill) / tokens
    return TriForceCandidate(0, gamma, retrieval.budget, retrieval.chunk, retrieval.stride, record.acceptance,
                             record.acceptance, float(gamma), tokens / steps, seconds / steps, per_token,
                             (ar_seconds / tokens) / per_token, streaming=True)


def streaming_seconds(profile: LatencyProfile, record: StreamingRecord, streaming_cache: int) -> float:
    """c_s: the streaming drafter's one-token step over its cache of sinks + window tokens."""
    if record.drafter == "draft":
        return _bottom_seconds("model", profile, streaming_cache)
    return float(profile.latency(1, streaming_cache))


def window_prefill_seconds(profile: LatencyProfile, role: str, sinks: int, window: int) -> float:
    """w: the `role` model's prefill of its StreamingLLM window, as profiled; 0 (unpriced) if not profiled."""
    return profile.window_prefill(role, sinks, window) or 0.0


def _top_costs(profile: LatencyProfile, context: int, length: int) -> np.ndarray:
    """table[n, p] = t(n, context + p) + o(n) for n = 0..max profiled size (row 0 unused), p < length."""
    sizes = np.arange(1, _max_n(profile) + 1)
    table = np.zeros((len(sizes) + 1, length))
    for p in range(length):
        table[1:, p] = profile.latency(sizes, context + p)
    table[1:] += profile.engine_overhead(sizes)[:, None]
    return table


NO_RUNS = np.zeros(0, dtype=np.int64)


@njit(cache=True)
def _replay_trace(middle: np.ndarray, bottom: np.ndarray, runs: np.ndarray, gamma1: int, gamma2: int,
                  round_cost: float, top_costs: np.ndarray) -> tuple[float, float, float]:
    """Expected (seconds, steps) to emit one continuation, and its mean chain length (see the docstring).
    `runs` is empty where the bottom's runs come from its per-position acceptances `bottom`."""
    length = len(middle)
    largest = top_costs.shape[0] - 1
    bottom_mean = bottom.mean()
    run_mean = runs.mean() if len(runs) else 0.0
    seconds = np.zeros(length + 1)
    steps = np.zeros(length + 1)
    chain_sum = 0.0
    for p in range(length - 1, -1, -1):
        if gamma1 == 0:
            rounds, chain = gamma2, gamma2
        else:
            rounds, collected, start = 0, 0.0, float(p)
            while collected < gamma2:
                run, per_round = 1.0, 1.0
                if len(runs):
                    q = int(start)
                    per_round += runs[q] if q < length else run_mean
                else:
                    for j in range(gamma1):
                        q = int(start) + j
                        run *= bottom[q] if q < length else bottom_mean
                        per_round += run
                collected += per_round
                start += per_round
                rounds += 1
            chain = int(round(collected))
        chain_sum += chain
        expected_seconds = expected_steps = 0.0
        run = 1.0
        for j in range(chain + 1):
            accept = (middle[p + j] if p + j < length else 1.0) if j < chain else 0.0
            after = min(p + j + 1, length)
            expected_seconds += run * (1.0 - accept) * seconds[after]
            expected_steps += run * (1.0 - accept) * steps[after]
            run *= accept
        seconds[p] = rounds * round_cost + top_costs[min(chain + 1, largest), p] + expected_seconds
        steps[p] = 1.0 + expected_steps
    return seconds[0], steps[0], chain_sum / length


def _decoded_settings(candidate: TriForceCandidate, bottom: str) -> dict[str, int | str]:
    """The plan settings a candidate decodes with: those an acceptance file's `decoded_with` records."""
    values = {"bottom": "streaming" if candidate.streaming else "none" if candidate.gamma1 == 0 else bottom,
              "gamma1": max(candidate.gamma1, 1),
              "gamma2": candidate.gamma2, "budget": candidate.budget, "chunk": candidate.chunk,
              "stride": candidate.stride}
    return {key: values[key] for key in TRIFORCE_DECODED_SETTINGS}


def _bottom_seconds(bottom: str, profile: LatencyProfile, streaming_cache: int) -> float:
    """c_b: the trie's retrieval, or the draft model's one-token step over its StreamingLLM cache."""
    if bottom == "trie":
        return TRIE_SECONDS_PER_DRAFT
    seconds = profile.draft_step(streaming_cache)
    if seconds is None:
        raise UserError("a model bottom needs its step cost: a profile that times the draft")
    return seconds


def _max_n(profile: LatencyProfile) -> int:
    curves = profile.target_by_context or {0: profile.target_t_seconds}
    return min(max(points) for points in curves.values())


def solve_triforce(acceptance_path: str | Path, profile_path: str | Path, context: int | None = None,
                   bottom_seconds: float | None = None, two_level: bool = False,
                   rebuild_below: float = 0.0, min_speedup: float = 1.0) -> tuple[Plan, list[TriForceCandidate]]:
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
    if measured and measured != acceptance.target:
        raise UserError(f"{acceptance_path} and {profile_path}: the acceptance is for {shown(acceptance.target)} but "
                        f"the profile for {shown(measured)}")
    bottom = "none" if two_level else ("trie" if acceptance.bottom == "trie" else "model")
    sinks, window = acceptance.bottom_cache or (STREAMING_SINKS, STREAMING_WINDOW)
    if bottom_seconds is None and bottom != "none":
        bottom_seconds = _bottom_seconds(bottom, profile, sinks + window)
    started = time.perf_counter()
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
    candidates.sort(key=lambda c: (-c.speedup, c.gamma2, c.gamma1, c.budget))
    best_two_level = next(c for c in candidates if c.gamma1 == 0)
    record = None if two_level else acceptance.streaming_at(context)
    streaming_draft = None
    if record is not None:
        streaming_draft = streaming_seconds(profile, record, sinks + window)
        streaming_prefill = window_prefill_seconds(profile, record.drafter, sinks, window)
        candidates += [evaluate_streaming(profile, context, record, gamma, streaming_draft, top_costs, best_two_level,
                                          streaming_prefill)
                       for gamma in GAMMA2]
        candidates.sort(key=lambda c: (-c.speedup, c.gamma2, c.gamma1, c.budget))
    decoded_with = acceptance.decoded_with
    exact = next((c for c in candidates if decoded_with and all(
        decoded_with.get(key) == value for key, value in _decoded_settings(c, bottom).items())), None)
    best = candidates[0]
    if exact is not None and best.speedup < exact.speedup * (1.0 + REPLAY_SWITCH_MARGIN):
        best = exact
    speculate = bool(best.speedup > min_speedup)
    settings = TriForceSettings(**_decoded_settings(best, bottom), context=context, rebuild_below=rebuild_below,
                                sinks=sinks, window=window, speculate=speculate).check()
    bottom = settings.bottom
    # whose window prefill the plan's decoding pays (None in the plan: not profiled, so unpriced)
    streaming_role = record.drafter if bottom == "streaming" else "draft" if bottom == "model" else None
    models = {"target": acceptance.target}
    if bottom == "model" or (bottom == "streaming" and record.drafter == "draft"):
        models["draft"] = acceptance.bottom
    if profile.dtype:
        models["dtype"] = profile.dtype
    speculative = {"tokens_per_step": best.tokens_per_step, "speedup": best.speedup,
                   "seconds_per_token": best.seconds_per_token, "chain_tokens": best.chain_tokens,
                   "middle_acceptance": best.middle_acceptance, "bottom_acceptance": best.bottom_acceptance}
    prediction = speculative if speculate else {
        "tokens_per_step": 1.0, "speedup": 1.0, "seconds_per_token": best.seconds_per_token * best.speedup,
        "best_speculative": speculative}
    prediction.update({
        "latency_source": profile.source,
        "build_source": "measured" if profile.retrieval_build(context, best.budget) is not None
        else "t(1, L): the profile times no retrieval build",
        # `plan bench` runs its two-level baseline with these settings, the variant at its own best
        "best_two_level": {"gamma2": best_two_level.gamma2, "budget": best_two_level.budget,
                           "chunk": best_two_level.chunk, "stride": best_two_level.stride,
                           "speedup": best_two_level.speedup, "tokens_per_step": best_two_level.tokens_per_step}})
    if record is not None:  # `plan bench` runs its streaming baseline with this gamma
        best_streaming = next(c for c in candidates if c.streaming)
        prediction["best_streaming"] = {"drafter": record.drafter, "gamma2": best_streaming.gamma2,
                                        "speedup": best_streaming.speedup,
                                        "tokens_per_step": best_streaming.tokens_per_step}
    if decoded_with and speculate:
        prediction["replay_exact"] = best is exact
    plan = Plan(
        method="triforce",
        models=models,
        prediction=prediction,
        inputs={"acceptance": {"file": str(acceptance_path)}, "profile": profile.plan_inputs(profile_path),
                "context": context, "bottom_seconds_per_draft": bottom_seconds,
                **({"streaming_seconds_per_draft": streaming_draft} if record is not None else {}),
                **({"window_prefill_seconds": profile.window_prefill(streaming_role, sinks, window)}
                   if streaming_role else {})},
        solver={"seconds": time.perf_counter() - started, "min_speedup": min_speedup,
                "algorithm": "expected time per token, " + ("replayed over the acceptance traces" if replayed
                                                            else "closed form") + " (planner/triforce.py)",
                "top": [asdict(c) for c in candidates[:10]]},
        provenance=provenance([acceptance_path, profile_path]),
        sampling={"temperature": acceptance.temperature},
        settings=settings,
    )
    return plan, candidates


# --- re-pricing a plan --------------------------------------------------------------------------------------

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
            raise UserError(f"{path} has no entry for context {s['context']}, "
                            f"budget {budget}, chunk {chunk}, stride {stride}: not the plan's acceptance file")
        return found

    two = plan.prediction.get("best_two_level") or s
    two_level = (entry(two["budget"], two["chunk"], two["stride"]), 0, two["gamma2"], None)
    if s.bottom == "streaming":
        record = acceptance.streaming_at(s.context)
        if record is None:
            raise UserError(f"{path} has no streaming draft measured at context {s['context']}: "
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
            target[L] = max(target.get(L, 1), min(gamma2 + gamma1 + 2, _max_n(profile)))  # the longest chain + 1
    draft = []
    if draft_priced and profile.draft_by_context:
        draft = covering(profile.draft_by_context, streaming_cache, streaming_cache)
    prefill_role = _window_prefill_role(settings[0][0], settings[0][1], plan.settings.bottom)
    if prefill_role and profile.window_prefill(prefill_role, plan.settings.sinks, plan.settings.window) is None:
        prefill_role = None
    return PricedPoints({L: profile.target_curve(L).support(largest) for L, largest in sorted(target.items())},
                        {L: sorted(budgets) for L, budgets in sorted(builds.items())}, draft, prefill_role)


def _window_prefill_role(entry: TriForceEntry, gamma1: int, bottom: str) -> str | None:
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
        bottom_seconds = _bottom_seconds("model", profile, sinks + window)
    priced = evaluate_traces(profile, context, entry, gamma1, gamma2, bottom_seconds, {}, prefill) \
        if entry.traces else evaluate(profile, context, entry, gamma1, gamma2, bottom_seconds)
    return priced, priced_two
