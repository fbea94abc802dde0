"""TriForce's cost model: the expected time per token of one setting, in closed form or replayed over traces.

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
trace, each round one draft at c_s). A continuation's first step is plain (the decoder's: its forward over the
full cache gives the query that scores the chunks), t(1, L) for its first token, then drafted steps from
position 1 and its first build, b(L, B); a streaming or model drafter also prefills its window, w. Then

    time per token = [sum of (t(1, L) + time(1) + b(L, B) + w + floor((N - 1) / R') b(L, B))] / sum of N,

over the continuations, of N tokens each (a rebuild falls due after the tokens of a step are inserted and
is built when the next step starts, so none follows the last token; the streaming draft has neither builds
nor t(1, L)). The autoregressive time is the sum of t(1, L + p) over the positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from specplan.core.acceptance_schema import TRIFORCE_GAMMA1, StreamingRecord, TriForceEntry
from specplan.core.errors import UserError
from specplan.core.profile_schema import LatencyProfile
from specplan.planner.closed_loop import SettingPrice

GAMMA1 = TRIFORCE_GAMMA1
GAMMA2 = tuple(range(1, 17))
TRIE_SECONDS_PER_DRAFT = 2e-4  # one retrieval plus insertion (bench/trie.py measures it)


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
    top = _forward_seconds(profile, min(chain + 1, largest_profiled_n(profile)), context)
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
    tokens = drafted_tokens = steps = seconds = ar_seconds = chains = 0.0
    for trace in entry.traces:
        length = len(trace.middle)
        if length not in top_costs:
            top_costs[length] = _top_costs(profile, context, length)
        table = top_costs[length]
        runs = trace.bottom_runs[gamma1 - 1] if trace.bottom_runs is not None and gamma1 else NO_RUNS
        trace_seconds, trace_steps, mean_chain = _replay_trace(trace.middle, trace.bottom, runs, gamma1,
                                                               gamma2, round_cost, table, PLAIN_FIRST)
        tokens += length
        drafted_tokens += length - PLAIN_FIRST
        steps += trace_steps
        seconds += trace_seconds
        ar_seconds += table[1].sum()
        chains += mean_chain * length
    t1 = _forward_seconds(profile, 1, context)
    build = build_seconds(profile, context, entry.budget)
    rebuilds = sum((len(trace.middle) - 1) // refill(entry) for trace in entry.traces)
    per_token = (seconds + len(entry.traces) * (t1 + build + window_prefill) + rebuilds * build) / tokens
    # a drafted step's yield and time (the plain first steps apart)
    tokens_per_step, step_seconds = (drafted_tokens / steps, seconds / steps) if steps else (1.0, t1)
    return TriForceCandidate(gamma1, gamma2, entry.budget, entry.chunk, entry.stride, entry.middle,
                             entry.bottom, chains / tokens, tokens_per_step, step_seconds, per_token,
                             (ar_seconds / tokens) / per_token)


def setting_price(profile: LatencyProfile, context: int, entry: TriForceEntry, gamma1: int, gamma2: int,
                  bottom: str, bottom_seconds: float | None, window: int, window_prefill: float = 0.0) -> SettingPrice:
    """One sequence's step at (gamma1, gamma2) in a batch's price (planner/closed_loop.py): the tokens per step, the
    chain's rows and the middle rounds, replayed over the traces as above; the rounds' bottom drafts (batched draft
    forwards over the StreamingLLM window for a model bottom, a trie's per sequence) and the retrieval cache's builds
    spread over the tokens they cover (b(L, B) / R' per token); the plain first step and the first build (t(1, L) +
    b(L, B)) and a model bottom's window prefill w once per request (the drafted steps are replayed from position 1
    and priced for every token: the first step's is left to them). A batch's middle rounds are priced at each
    sequence's mean count."""
    if bottom_seconds is None:
        gamma1 = 0
    length_of = {len(trace.middle) for trace in entry.traces}
    rounds_only = {n: np.zeros((largest_profiled_n(profile) + 1, n)) for n in length_of}  # forwards priced at 0
    tokens = drafted_tokens = steps = rounds = chains = 0.0
    for trace in entry.traces:
        runs = trace.bottom_runs[gamma1 - 1] if trace.bottom_runs is not None and gamma1 else NO_RUNS
        trace_rounds, trace_steps, mean_chain = _replay_trace(trace.middle, trace.bottom, runs, gamma1, gamma2, 1.0,
                                                              rounds_only[len(trace.middle)], PLAIN_FIRST)
        tokens += len(trace.middle)
        drafted_tokens += len(trace.middle) - PLAIN_FIRST
        steps += trace_steps
        rounds += trace_rounds
        chains += mean_chain * len(trace.middle)
    tokens_per_step, rounds_per_step = (drafted_tokens / steps, rounds / steps) if steps else (1.0, 0.0)
    build = build_seconds(profile, context, entry.budget)
    first_build = _forward_seconds(profile, 1, context) + build
    host = tokens_per_step * build / refill(entry)
    model = bottom == "model" and gamma1 > 0
    if bottom == "trie" and gamma1:
        host += rounds_per_step * gamma1 * bottom_seconds
    return SettingPrice(tokens_per_step, rows=chains / tokens + 1.0, host_seconds=host,
                        draft_levels=rounds_per_step * gamma1 if model else 0.0,
                        draft_context=window if model else None, middle_rounds=rounds_per_step,
                        middle_rows=gamma1 + 1, middle_context=entry.budget + entry.chunk,
                        request_seconds=first_build + (window_prefill if model else 0.0))


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
                                                      table, 0)
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
        return bottom_draft_seconds("model", profile, streaming_cache)
    return float(profile.latency(1, streaming_cache))


def window_prefill_seconds(profile: LatencyProfile, role: str, sinks: int, window: int) -> float:
    """w: the `role` model's prefill of its StreamingLLM window, as profiled; 0 (unpriced) if not profiled."""
    return profile.window_prefill(role, sinks, window) or 0.0


def _top_costs(profile: LatencyProfile, context: int, length: int) -> np.ndarray:
    """table[n, p] = t(n, context + p) + o(n) for n = 0..max profiled size (row 0 unused), p < length."""
    sizes = np.arange(1, largest_profiled_n(profile) + 1)
    table = np.zeros((len(sizes) + 1, length))
    for p in range(length):
        table[1:, p] = profile.latency(sizes, context + p)
    table[1:] += profile.engine_overhead(sizes)[:, None]
    return table


NO_RUNS = np.zeros(0, dtype=np.int64)
# The position a hierarchy's first drafted step starts at: its first step is plain (decoder/triforce.py)
PLAIN_FIRST = 1


@njit(cache=True)
def _replay_trace(middle: np.ndarray, bottom: np.ndarray, runs: np.ndarray, gamma1: int, gamma2: int,
                  round_cost: float, top_costs: np.ndarray, first: int) -> tuple[float, float, float]:
    """Expected (seconds, steps) to emit one continuation from position `first` on, and its mean chain length over
    all positions (see the docstring). `runs` is empty where the bottom's runs come from its per-position
    acceptances `bottom`."""
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
    return seconds[first], steps[first], chain_sum / length


def bottom_draft_seconds(bottom: str, profile: LatencyProfile, streaming_cache: int) -> float:
    """c_b: the trie's retrieval, or the draft model's one-token step over its StreamingLLM cache."""
    if bottom == "trie":
        return TRIE_SECONDS_PER_DRAFT
    seconds = profile.draft_step(streaming_cache)
    if seconds is None:
        raise UserError("a model bottom needs its step cost: a profile that times the draft")
    return seconds


def largest_profiled_n(profile: LatencyProfile) -> int:
    curves = profile.target_by_context or {0: profile.target_t_seconds}
    return min(max(points) for points in curves.values())
