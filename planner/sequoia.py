"""Sequoia's hardware-aware optimizer: the tree size and depth that maximise wall-clock speedup.

For a tree of n nodes (root included) and depth d, one decoding step costs d draft forwards and one
target forward over B * n new tokens (B = batch), and yields G(n, d) tokens per sequence on average:

    speedup(n, d) = G(n, d) * (t(B) + o(B)) / (t(B * n) + o(B * n) + d * c_draft)

t(B) is one autoregressive step of the same batch, so B = 1 gives the paper's G * t(1) / (t(n) + d c), with
o(n), the decoding engine's time per step outside the target's forward (mask, verification walk, commit),
added where the profile measured it.
Without a profile the optimizer maximises G alone over n <= N, d <= D.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from core.acceptance_schema import SequoiaAcceptance, load_sequoia_acceptance
from core.errors import UserError
from core.fileio import shown
from core.plan_schema import Plan, TokenTree
from core.profile_schema import LatencyProfile, load_profile
from core.provenance import provenance
from planner.sequoia_dp import SequoiaTables


@dataclass(frozen=True)
class Candidate:
    size: int
    depth: int
    tokens_per_step: float
    step_seconds: float | None = None
    speedup: float | None = None
    tokens_per_second: float | None = None


def rank_candidates(tables: SequoiaTables, profile: LatencyProfile | None = None, batch: int = 1,
                    context: int | None = None) -> list[Candidate]:
    """Every non-dominated (n, d), best first: by speedup with a profile, by G without one.

    (n, d) is dropped when G(n, d) == G(n, d - 1): the deeper bound did not change the tree's value,
    so it only adds draft cost. Ties are broken towards smaller n, then smaller d.
    """
    G = tables.G
    sizes = np.arange(G.shape[0])
    feasible = np.isfinite(G)
    feasible[0, :] = False
    feasible[:, 1:] &= G[:, 1:] > G[:, :-1]
    if profile is None:
        candidates = [Candidate(int(n), int(d), float(G[n, d])) for n, d in zip(*np.nonzero(feasible))]
        return sorted(candidates, key=lambda c: (-c.tokens_per_step, c.size, c.depth))

    curve = profile.target_curve(context)
    c_draft = profile.draft_step(context)
    if c_draft is None:
        raise UserError("the profile has no draft.step_seconds: Sequoia needs the draft's per-step cost")
    max_n = min(tables.max_size, curve.max_n // batch)
    if max_n < 1:
        raise UserError(f"the profile covers t(n) up to n = {curve.max_n}, less than the batch {batch}")
    feasible[max_n + 1:, :] = False
    t_batch = float(curve(batch) + profile.engine_overhead(batch))
    t_target = np.zeros(G.shape[0])
    t_target[1:max_n + 1] = curve(sizes[1:max_n + 1] * batch) + profile.engine_overhead(sizes[1:max_n + 1] * batch)
    out = []
    for n, d in zip(*np.nonzero(feasible)):
        step = t_target[n] + d * c_draft
        g = float(G[n, d])
        out.append(Candidate(int(n), int(d), g, step, g * t_batch / step, batch * g / step))
    return sorted(out, key=lambda c: (-c.speedup, c.size, c.depth))


def solve_sequoia(acceptance_path: str | Path, max_size: int, max_depth: int, profile_path: str | Path | None = None,
                  batch: int = 1, context: int | None = None) -> tuple[Plan, list[Candidate]]:
    if max_size < 1:
        raise UserError(f"the largest tree size must be >= 1, got {max_size}")
    if max_depth < 0:
        raise UserError(f"the largest tree depth must be >= 0, got {max_depth}")
    if batch < 1:
        raise UserError(f"the batch size must be >= 1, got {batch}")
    acceptance = load_sequoia_acceptance(acceptance_path)
    profile = load_profile(profile_path) if profile_path is not None else None
    models = _models(acceptance, profile, f"{acceptance_path} and {profile_path}")

    SequoiaTables(acceptance.positional, 2, 1)  # compile or load the numba cache outside the timing
    start = time.perf_counter()
    tables = SequoiaTables(acceptance.positional, max_size, max_depth)
    dp_seconds = time.perf_counter() - start

    ranked = rank_candidates(tables, profile, batch, context)
    if not ranked:
        raise UserError("no feasible tree within the given size, depth and profile range")
    plan = _assemble_plan(tables, ranked[0], ranked, acceptance, acceptance_path, profile, profile_path, models,
                          max_size, max_depth, batch, context)
    plan.solver["seconds"] = dp_seconds
    return plan, ranked


def _models(acceptance: SequoiaAcceptance, profile: LatencyProfile | None, files: str) -> dict:
    models = {"target": acceptance.target, "draft": acceptance.draft}
    if profile is not None:
        if profile.draft_vocab != acceptance.draft_vocab:
            raise UserError(f"{files}: the acceptance file's draft vocabulary ({acceptance.draft_vocab or 'all'}) "
                            f"differs from the one the profile timed ({profile.draft_vocab or 'all'}): measure both "
                            "with the same draft vocabulary")
        for role in ("target", "draft"):
            measured = profile.models.get(role)
            if measured and models[role] and measured != models[role]:
                raise UserError(f"{files}: the acceptance file is for {role} {shown(models[role])} but the profile "
                                f"for {shown(measured)}")
            models[role] = models[role] or measured
    return {k: v for k, v in models.items() if v}


def _assemble_plan(tables: SequoiaTables, best: Candidate, ranked: list[Candidate], acceptance: SequoiaAcceptance,
                   acceptance_path: str | Path, profile: LatencyProfile | None, profile_path: str | Path | None,
                   models: dict, max_size: int, max_depth: int, batch: int, context: int | None) -> Plan:
    """The plan file for the chosen (n, d): its tree, prediction, and the inputs `plan show` redraws it from."""
    tree = TokenTree.from_parents(tables.tree(best.size, best.depth))
    prediction = {"tokens_per_step": best.tokens_per_step}
    if profile is not None:
        prediction.update(speedup=best.speedup, step_seconds=best.step_seconds,
                          tokens_per_second=best.tokens_per_second, latency_source=profile.source)
    inputs: dict = {
        "acceptance": {"file": str(acceptance_path), "positional": [float(x) for x in acceptance.positional]},
        "max_size": max_size, "max_depth": max_depth, "batch": batch,
    }
    if profile is not None:
        curve = profile.target_curve(context)
        inputs["profile"] = {
            **profile.plan_inputs(profile_path), "context": context if context is not None else profile.target_context,
            "target_t_seconds": {int(n): float(t) for n, t in curve.points.items()},
            "draft_step_seconds": profile.draft_step(context),
            **({"engine_overhead_seconds": dict(profile.overhead_seconds)} if profile.overhead_seconds else {}),
        }
    sampling = {k: v for k, v in (("temperature", acceptance.temperature), ("top_p", acceptance.top_p))
                if v is not None}
    plan = Plan(
        method="sequoia",
        models=models,
        prediction=prediction,
        inputs=inputs,
        solver={"seconds": 0.0, "algorithm": "depth-bounded tree DP (numba)",
                "width": len(acceptance.positional),
                "top": [asdict(c) for c in ranked[:10]]},
        provenance=provenance([acceptance_path] + ([profile_path] if profile_path else [])),
        sampling=sampling,
        tree=tree,
    )
    if profile is not None:
        for key in ("dtype", "draft_dtype"):
            if getattr(profile, key):
                plan.models[key] = getattr(profile, key)
    if acceptance.draft_vocab is not None:
        plan.models["draft_vocab"] = acceptance.draft_vocab
    return plan
