"""TriForce's gamma1, gamma2, budget, chunk size and rebuild stride, from an expected-time-per-token model.

Inputs at the plan's context L: a_m, the per-token acceptance of the middle level (target over a retrieval
cache of budget B, chunk s, stride R) against the full target; a_b, the bottom drafter's against the middle
level (both from `plan accept triforce`); t(n, L), the target's forward time (from `plan profile`, whose
contexts also cover the budgets: the middle level is the target at context about B + s); c_b, the bottom's
cost per drafted token (a draft model's t_d(1) over its StreamingLLM window, or the trie's retrieval time).

With acceptance rate a, a chain of g drafts yields on average E(a, g) = (1 - a^(g+1)) / (1 - a) tokens
(the accepted prefix plus the corrected or bonus token). One top-level step:

- middle rounds: the bottom drafts gamma1 tokens (cost gamma1 * c_b), the middle verifies them in one forward
  (t(gamma1 + 1, B + s)) and yields E(a_b, gamma1) tokens; k = ceil(gamma2 / E(a_b, gamma1)) rounds collect a
  chain of n = k * E(a_b, gamma1) >= gamma2 tokens;
- the top verifies the chain (t(n + 1, L)) and keeps E(a_m, n) tokens;
- a retrieval-cache rebuild, at most one forward's worth of reading (t(1, L)), every R tokens.

    time per token = [k * (gamma1 * c_b + t(gamma1 + 1, B + s)) + t(n + 1, L)] / E(a_m, n) + t(1, L) / R
    predicted speedup = t(1, L) / time per token

The two-level variant (no bottom) has gamma1 = 0: each middle round is one forward t(1, B + s) yielding one
token. Acceptances are treated as independent per token, which real text is not; the bench reports the gap.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specplan.acceptance_schema import load_triforce_acceptance
from specplan.errors import UserError
from specplan.plan_schema import Plan
from specplan.profile_schema import LatencyProfile, load_profile
from specplan.provenance import provenance

GAMMA1 = tuple(range(1, 9))
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


def evaluate(profile: LatencyProfile, context: int, entry: dict, gamma1: int, gamma2: int,
             bottom_seconds: float | None) -> TriForceCandidate:
    """The model above for one setting; bottom_seconds None means no bottom (the two-level variant)."""
    middle_context = entry["budget"] + entry["chunk"]
    if bottom_seconds is None:
        per_round, round_cost = 1.0, float(profile.latency(1, middle_context))
        gamma1 = 0
    else:
        per_round = expected_tokens(entry["bottom"], gamma1)
        round_cost = gamma1 * bottom_seconds + float(profile.latency(gamma1 + 1, middle_context))
    rounds = math.ceil(gamma2 / per_round)
    chain = rounds * per_round
    top = float(profile.latency(min(chain + 1, _max_n(profile)), context))
    tokens = expected_tokens(entry["middle"], chain)
    step = rounds * round_cost + top
    t1 = float(profile.latency(1, context))
    per_token = step / tokens + t1 / entry["stride"]
    return TriForceCandidate(gamma1, gamma2, entry["budget"], entry["chunk"], entry["stride"], entry["middle"],
                             entry["bottom"], chain, tokens, step, per_token, t1 / per_token)


def _max_n(profile: LatencyProfile) -> int:
    curves = profile.target_by_context or {0: profile.target_t_seconds}
    return min(max(points) for points in curves.values())


def solve_triforce(acceptance_path: str | Path, profile_path: str | Path, context: int | None = None,
                   bottom_seconds: float | None = None, two_level: bool = False,
                   rebuild_below: float = 0.0) -> tuple[Plan, list[TriForceCandidate]]:
    acceptance = load_triforce_acceptance(acceptance_path)
    profile = load_profile(profile_path)
    contexts = sorted({e["context"] for e in acceptance.entries})
    context = context or contexts[-1]
    entries = [e for e in acceptance.entries if e["context"] == context]
    if not entries:
        raise UserError(f"{acceptance_path} has no measurements at context {context} (it has {contexts})")
    measured = profile.models.get("target")
    if measured and measured != acceptance.target:
        raise UserError(f"the acceptance is for {acceptance.target!r} but the profile for {measured!r}")
    bottom = "none" if two_level else ("trie" if acceptance.bottom == "trie" else "model")
    if bottom == "model" and bottom_seconds is None:
        bottom_seconds = profile.draft_step()
        if bottom_seconds is None:
            raise UserError("a model bottom needs its step cost: profile the draft (plan profile --draft)")
    if bottom == "trie" and bottom_seconds is None:
        bottom_seconds = TRIE_SECONDS_PER_DRAFT
    started = time.perf_counter()
    candidates = []
    for entry in entries:
        for gamma1 in (GAMMA1 if bottom != "none" else (1,)):
            for gamma2 in GAMMA2:
                if gamma2 >= gamma1:
                    candidates.append(evaluate(profile, context, entry, gamma1, gamma2,
                                               None if bottom == "none" else bottom_seconds))
    candidates.sort(key=lambda c: (-c.speedup, c.gamma2, c.gamma1, c.budget))
    best = candidates[0]
    cache = acceptance.extra.get("bottom_cache") or {}
    settings = {"gamma1": max(best.gamma1, 1), "gamma2": best.gamma2, "budget": best.budget, "chunk": best.chunk,
                "stride": best.stride, "context": context, "rebuild_below": rebuild_below, "bottom": bottom,
                "sinks": int(cache.get("sinks", 4)), "window": int(cache.get("window", 1024))}
    models = {"target": acceptance.target}
    if bottom == "model":
        models["draft"] = acceptance.bottom
    if profile.raw.get("dtype"):
        models["dtype"] = profile.raw["dtype"]
    plan = Plan(
        method="triforce",
        models=models,
        prediction={"tokens_per_step": best.tokens_per_step, "speedup": best.speedup,
                    "seconds_per_token": best.seconds_per_token, "chain_tokens": best.chain_tokens,
                    "middle_acceptance": best.middle_acceptance, "bottom_acceptance": best.bottom_acceptance,
                    "latency_source": profile.source},
        inputs={"acceptance": {"file": str(acceptance_path)}, "profile": {"file": str(profile_path)},
                "context": context, "bottom_seconds_per_draft": bottom_seconds},
        solver={"seconds": time.perf_counter() - started, "algorithm": "expected time per token (planner/triforce.py)",
                "top": [asdict(c) for c in candidates[:10]]},
        provenance=provenance([acceptance_path, profile_path]),
        sampling={"temperature": acceptance.temperature},
        settings=settings,
    )
    return plan, candidates
