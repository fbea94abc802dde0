"""`plan show`: readable views (and plots) of plans, profiles, acceptance files and bench reports."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from specplan.core.acceptance_schema import LookaheadAcceptance, SequoiaAcceptance, TriForceAcceptance
from specplan.core.errors import UserError
from specplan.core.fileio import read_yaml, shown
from specplan.core.machine import machine_label
from specplan.core.plan_schema import BatchSchedule, Plan, TokenTree, setting_name
from specplan.core.plotting import pyplot, save_png
from specplan.core.profile_schema import LatencyProfile
from specplan.core.validate import Fields


def show_files(paths: list[str | os.PathLike], plot: str | os.PathLike | None = None,
               compare: str | os.PathLike | None = None) -> str:
    """One plan, profile or acceptance file; or one or more `plan bench` reports (.json), whose plot is the
    summary of all of them."""
    if paths and all(Path(p).suffix == ".jsonl" for p in paths):  # plan bench --concurrency results
        from specplan.serving import load_levels, plot_levels, serving_table

        if compare is not None:
            raise UserError("--compare applies to profiles only")
        levels = [level for p in paths for level in load_levels(p)]
        if plot is not None:
            stems = [Path(p).stem for p in paths]
            shared = os.path.commonprefix(stems).rstrip(".-_")
            title = stems[0] if len(stems) == 1 else f"{shared or ', '.join(stems)}: {len(stems)} runs (mean, range)"
            plot_levels(levels, plot, title)
        return serving_table(levels)
    if paths and all(Path(p).suffix == ".json" for p in paths):
        from specplan.bench import load_report, markdown_table, plot_summary

        if compare is not None:
            raise UserError("--compare applies to profiles only")
        reports = [load_report(p) for p in paths]
        try:
            if plot is not None:
                plot_summary(reports, Path(plot))
            return "\n\n".join(markdown_table(r) for r in reports)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            # load_report checks the fields every report has; a method's optional sections (a plan's prediction,
            # its re-pricing) are read as written, so one edited by hand fails here, in one line
            raise UserError(f"a bench report with a malformed optional section ({exc.__class__.__name__}: "
                            f"{str(exc)[:80]})") from None
    if len(paths) != 1:
        raise UserError("several files are shown together only when all are plan bench reports (.json)")
    return show_file(paths[0], plot, compare)


def show_file(path: str | os.PathLike, plot: str | os.PathLike | None = None,
              compare: str | os.PathLike | None = None) -> str:
    data = read_yaml(path)
    text = describe_file(data, path, plot, compare)
    provenance = data.get("provenance")
    command = provenance.get("command") if isinstance(provenance, dict) else None
    if isinstance(command, str) and not str(data.get("kind")).startswith("plan/"):  # a plan shows its provenance
        text += f"\nwritten by: {command}"
    return text


def describe_file(data: dict[str, Any], path: str | os.PathLike, plot: str | os.PathLike | None,
                  compare: str | os.PathLike | None) -> str:
    """A plan, profile or acceptance file's text (and its plot), by its kind."""
    kind = data.get("kind")
    if kind == "profile/latency":
        profile = LatencyProfile.from_dict(data, str(path))
        others = [LatencyProfile.from_dict(read_yaml(compare), str(compare))] if compare else []
        if plot is not None:
            plot_profiles([profile] + others, plot)
        text = "\n\n".join(describe_profile(p) for p in [profile] + others)
        return text + ("\n\n" + compare_profiles(profile, others[0]) if others else "")
    if compare is not None:
        raise UserError("--compare applies to profiles only")
    if kind == "acceptance/lookahead":
        acceptance = LookaheadAcceptance.from_dict(data, str(path))
        generated = [len(r.output) for r in acceptance.records]
        return (f"acceptance/lookahead: greedy outputs of {acceptance.target} on {len(generated)} prompts, "
                f"{sum(generated)} tokens (mean {np.mean(generated):.0f} per prompt)")
    if kind == "acceptance/triforce":
        acceptance = TriForceAcceptance.from_dict(data, str(path))
        lines = [f"acceptance/triforce: {acceptance.target} with bottom {acceptance.bottom}, "
                 f"T = {acceptance.temperature}",
                 f"  {'L':>6} {'B':>5} {'s':>3} {'R':>4} {'middle':>7} {'bottom':>7} {'positions':>9}"]
        for e in acceptance.entries:
            lines.append(f"  {e.context:>6} {e.budget:>5} {e.chunk:>3} {e.stride:>4} {e.middle:>7.3f} "
                         f"{e.bottom:>7.3f} {e.extra.get('positions', 0):>9}")
        for r in acceptance.streaming:
            drafter = acceptance.bottom if r.drafter == "draft" else acceptance.target
            lines.append(f"  streaming draft ({drafter} over a StreamingLLM cache) at {r.context}: "
                         f"{r.acceptance:.3f} against the full target over {sum(map(len, r.traces))} positions")
        return "\n".join(lines)
    if kind == "acceptance/sequoia":
        acceptance = SequoiaAcceptance.from_dict(data, str(path))
        if plot is not None:
            plot_acceptance(acceptance, plot)
        return describe_acceptance(data)
    if isinstance(kind, str) and kind.startswith("plan/"):
        plan = Plan.from_dict(data, str(path))
        if plot is not None:
            plot_plan(plan, plot)
        return describe_plan(plan)
    raise UserError(f"{path}: cannot show a document of kind {shown(kind)}")


def describe_profile(profile: LatencyProfile) -> str:
    lines = [f"profile/latency ({profile.source}, {profile.backend} backend), dtype {profile.dtype or '?'}, models: "
             + ", ".join(f"{k}={v}" for k, v in profile.models.items())
             + (f", draft scores ids < {profile.draft_vocab}" if profile.draft_vocab else "")]
    machine = profile.hardware
    label = machine_label(profile.machine) if machine.get("gpu") else machine.get("cpu")
    if label:
        lines.append(f"hardware: {label}" + (f", {machine['threads']} threads" if "threads" in machine else ""))
    for L, entry in (profile.raw.get("target", {}).get("contexts") or {}).items():
        if isinstance(entry, dict) and "streamed_gb" in entry:
            kept = (f"{entry['resident_layers']} layers" if "resident_layers" in entry
                    else f"{entry.get('resident_tokens')} cached tokens")
            lines.append(f"  offloaded at L={L}: {entry['streamed_gb']:.2f} GB per GPU streamed every forward, "
                         f"{kept} kept on the device")
    by_context = profile.target_by_context or {profile.target_context or "?": profile.target_t_seconds}
    sizes = sorted({n for points in by_context.values() for n in points})
    every = profile.every_size_up_to
    if every > 8:  # timed at every n up to it (--row-totals): shown at powers of two and beyond
        sizes = [n for n in sizes if n > every or n & (n - 1) == 0]
    lines.append("target: t(n) in ms" + (f" (timed at every n up to {every}; shown at powers of two)"
                                          if every > 8 else ""))
    lines.append("  " + f"{'n':>6}" + "".join(f"{'L=' + str(L):>12}" for L in by_context))
    for n in sizes:
        row = "".join(f"{points[n] * 1e3:>12.2f}" if n in points else f"{'':>12}" for points in by_context.values())
        lines.append(f"  {n:>6}{row}")
    for L, by_budget in profile.builds_by_context.items():
        lines.append(f"  retrieval build at L={L}: " + ", ".join(
            f"B={budget} {seconds * 1e3:.2f} ms" for budget, seconds in by_budget.items()))
    if profile.overhead_seconds:
        lines.append(f"  engine overhead per step at L={profile.overhead_context or '?'}: " + ", ".join(
            f"n={n} {seconds * 1e3:.2f} ms" for n, seconds in profile.overhead_seconds.items()))
    for L, batches in profile.target_batches.items():
        lines.append(f"  batched steps at L={L}: aggregate tokens/s (B x n / t(B, n)) and t(B, n) in ms")
        for B, points in batches.items():
            lines.append(f"    B={B:<4}" + ", ".join(f"n={n} {B * n / seconds:.0f}/s {seconds * 1e3:.1f}"
                                                    for n, seconds in points.items()))
    if profile.draft_step_seconds is not None or profile.draft_by_context:
        steps = profile.draft_by_context or {profile.target_context or "?": profile.draft_step_seconds}
        lines.append("draft: step in ms " + ", ".join(f"L={L} {seconds * 1e3:.2f}" for L, seconds in steps.items()))
    for L, batches in profile.draft_batches.items():
        lines.append(f"  batched draft steps at L={L} in ms: " + ", ".join(
            f"B={B} {seconds * 1e3:.2f}" for B, seconds in batches.items()))
    for role, (sinks, window, seconds) in profile.window_prefills.items():
        lines.append(f"  {role}'s StreamingLLM window prefill ({sinks} sinks + {window} recent tokens): "
                     f"{seconds:.3f} s")
    if profile.measurement_seconds is not None:
        lines.append(f"measured in {profile.measurement_seconds} s")
    return "\n".join(lines)


def compare_profiles(reference: LatencyProfile, other: LatencyProfile) -> str:
    """Relative error of `other` against `reference`, per context and n (both points must exist)."""
    lines = [f"target t(n): {other.source} vs {reference.source}, relative error (other / reference - 1)"]
    contexts = sorted(set(reference.target_by_context) & set(other.target_by_context))
    if not contexts:
        return lines[0] + ": no context in common"
    lines.append("  " + f"{'n':>6}" + "".join(f"{'L=' + str(L):>12}" for L in contexts))
    sizes = sorted(set.intersection(*(set(reference.target_by_context[L]) & set(other.target_by_context[L])
                                      for L in contexts)))
    errors = []
    for n in sizes:
        row = []
        for L in contexts:
            error = other.target_by_context[L][n] / reference.target_by_context[L][n] - 1
            errors.append(abs(error))
            row.append(f"{error * 100:>+11.1f}%")
        lines.append(f"  {n:>6}" + "".join(row))
    lines.append(f"  mean |error| {np.mean(errors) * 100:.1f}%, max {np.max(errors) * 100:.1f}%")
    return "\n".join(lines)


def describe_acceptance(document: dict[str, Any]) -> str:
    positional = document["positional"]
    stderr = document.get("stderr") or [None] * len(positional)
    models = document.get("models") or {}
    lines = [f"{document['kind']}: draft {models.get('draft', '?')} for target {models.get('target', '?')}, "
             f"T = {document.get('temperature')}, top-p = {document.get('top_p')}, "
             f"{document.get('samples', '?')} positions",
             f"  {'k':>3} {'p_k':>8} {'stderr':>8} {'cumulative':>11}"]
    total = 0.0
    for k, (p, se) in enumerate(zip(positional, stderr), 1):
        total += p
        lines.append(f"  {k:>3} {p:>8.4f} {se if se is not None else float('nan'):>8.4f} {total:>11.4f}")
    return "\n".join(lines)


def plot_profiles(profiles: list[LatencyProfile], png: str | os.PathLike) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    curves = [(profile, profile.target_by_context or {profile.target_context or 0: profile.target_t_seconds})
              for profile in profiles]
    contexts = sorted({L for _, by_context in curves for L in by_context})  # one color per L across profiles
    for index, (profile, by_context) in enumerate(curves):
        style = ("-", "--", ":")[index % 3]  # one line style per profile, one color per context
        where = machine_label(profile.machine)
        for L, curve in sorted(by_context.items()):
            sizes = sorted(curve)
            ax.plot(sizes, [curve[n] * 1e3 for n in sizes], style, marker="o" if index == 0 else None, ms=3,
                    color=colors[contexts.index(L) % len(colors)], label=f"L = {L}: {where} ({profile.source})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("new tokens n")
    ax.set_ylabel("target forward t(n) [ms]")
    ax.set_title(f"{profiles[0].models.get('target', '?')}, {profiles[0].dtype or '?'}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save_png(fig, png)


def plot_acceptance(acceptance: SequoiaAcceptance, png: str | os.PathLike) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ranks = np.arange(1, len(acceptance.positional) + 1)
    ax.bar(ranks, acceptance.positional, yerr=acceptance.stderr, capsize=3, color="tab:blue", alpha=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("child rank k (sampling order)")
    ax.set_ylabel("p_k")
    ax.set_title(f"{acceptance.draft} -> {acceptance.target}, T = {acceptance.temperature}")
    ax.grid(alpha=0.3, axis="y")
    save_png(fig, png)


def _format_mapping(data: dict[str, Any], indent: str = "  ") -> list[str]:
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines.extend(_format_mapping(value, indent + "  "))
        elif isinstance(value, float):
            lines.append(f"{indent}{key}: {value:.6g}")
        elif isinstance(value, list) and len(value) > 8:
            head = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in value[:8])
            lines.append(f"{indent}{key}: [{head}, ...] ({len(value)} entries)")
        else:
            lines.append(f"{indent}{key}: {value}")
    return lines


def ascii_tree(tree: TokenTree, positional: list[float] | None = None) -> list[str]:
    """One line per node: rank path and, given the acceptance vector, the node's score f(v)."""
    children = tree.children
    ranks = tree.ranks
    score = [1.0] * tree.size
    if positional is not None:
        for v in range(1, tree.size):
            rank = ranks[v]
            score[v] = score[tree.parents[v]] * (positional[rank] if rank < len(positional) else 0.0)
    lines = []
    stack = [(0, "", True)]
    while stack:
        v, prefix, last = stack.pop()
        label = "root" if v == 0 else f"rank {ranks[v] + 1}"
        value = f"  f={score[v]:.4f}" if positional is not None else ""
        branch = "" if v == 0 else ("└── " if last else "├── ")
        lines.append(f"{prefix}{branch}[{v}] {label}{value}")
        extension = prefix + ("" if v == 0 else ("    " if last else "│   "))
        kids = children[v]
        stack.extend((child, extension, i == len(kids) - 1) for i, child in reversed(list(enumerate(kids))))
    return lines


def describe_engine_cost(plan: Plan) -> str:
    """A plan solved for a serving engine beside the unconstrained tree of the same inputs: what the engine's rules
    cost in tokens/step and in predicted speedup."""
    engine = Fields(plan.solver, f"{plan.source}: solver").sub("engine", required=False)
    tree = plan.tree
    own = f"{plan.prediction.tokens_per_step:.3f} tokens/step"
    if tree:
        own = f"n = {tree.size}, d = {tree.depth}, {own}"
    if plan.prediction.speedup is not None:
        own += f", {plan.prediction.speedup:.3f}x"
    if engine is None:
        return f"engine {plan.engine}: {own}"
    free = engine.sub("unconstrained")
    free_tokens = free.number("tokens_per_step", low=1.0)
    free_speedup = free.number("speedup", required=False, low=0.0)
    line = (f"engine {plan.engine} ({engine.string('shape')}): {own}; unconstrained tree: "
            f"n = {free.integer('size', low=1)}, d = {free.integer('depth', low=0)}, {free_tokens:.3f} tokens/step")
    ratio = f"tokens/step x{plan.prediction.tokens_per_step / free_tokens:.3f}"
    if free_speedup and plan.prediction.speedup is not None:
        line += f", {free_speedup:.3f}x"
        ratio += f", speedup x{plan.prediction.speedup / free_speedup:.3f}"
    return f"{line}\nthe engine's rules cost: {ratio}" + _describe_chain_knobs(plan)


def _describe_chain_knobs(plan: Plan) -> str:
    """A chain engine's own knobs, as replayed over the chain traces (planner/draft_chain.py), if the plan has them."""
    chain = Fields(plan.solver, f"{plan.source}: solver").sub("chain_knobs", required=False)
    if chain is None:
        return ""
    best = chain.sub("best")
    knobs = (f"draft-max {best.integer('draft_max', low=1)}, draft-min {best.integer('draft_min', low=0)}, "
             f"draft-p-min {best.number('p_min', low=0.0)}" if plan.engine == "llama.cpp" else
             f"num_assistant_tokens {best.integer('draft_max', low=1)}, schedule {best.string('schedule')}")
    found = (f"\n{plan.engine}'s knobs, replayed over the chain traces: {knobs}: "
             f"{best.number('tokens_per_step', low=1.0):.3f} tokens/step, {best.number('speedup', low=0.0):.3f}x")
    if not chain.boolean("enabled", default=True):
        found += "; no setting beats one-token decoding: the plan drafts nothing"
    return found


def describe_plan(plan: Plan) -> str:
    lines = [f"{plan.kind}  models: " + ", ".join(f"{k}={v}" for k, v in plan.models.to_dict().items())]
    if plan.engine != "specplan":
        lines.append(describe_engine_cost(plan))
    if plan.sampling:
        lines.append("sampling: " + ", ".join(f"{k}={v}" for k, v in plan.sampling.items()))
    lines.append("prediction:")
    lines.extend(_format_mapping(plan.prediction.to_dict()))
    if plan.tree is not None:
        depths = plan.tree.depths
        widths = [depths.count(k) for k in range(plan.tree.depth + 1)]
        lines.append(f"tree: {plan.tree.size} nodes, depth {plan.tree.depth}, nodes per level {widths}")
        lines.extend("  " + line for line in ascii_tree(plan.tree, _recorded_acceptance(plan, required=False)))
    if plan.settings is not None:
        lines.append(f"{plan.method}:")
        lines.extend(_format_mapping(plan.settings.to_dict()))
    if plan.schedule is not None:
        lines.append(describe_schedule(plan.schedule, plan.method))
    lines.append("inputs:")
    lines.extend(_format_mapping(plan.inputs))
    lines.append("solver:")
    lines.extend(_format_mapping({k: v for k, v in plan.solver.items() if k not in ("top", "schedule")}))
    lines.append("provenance:")
    lines.extend(_format_mapping(plan.provenance))
    return "\n".join(lines)


def describe_schedule(schedule: BatchSchedule, method: str) -> str:
    """A plan's setting per batch size, one line a range, with its prediction at the range's first size (and the priced
    setting's speedup at its last, where the plan carries one per size)."""
    lines = []
    covered = 0
    for table in schedule.tables:
        reach = (f", for sequences of {covered + 1} to {table.up_to_context} tokens" if table.up_to_context
                 else f", for sequences of {covered + 1} tokens and more" if covered else "")
        lines += [f"schedule per batch size (priced at context {table.context}{reach}):",
                  f"  {'batches':>9} {'setting':>10} {'tok/step':>9} {'tok/s':>8} {'vs off':>7}"]
        for e in table.entries:
            setting = setting_name(method, e.decoding_length if e.speculate else None)
            span = f"{e.low}" if e.low == e.high else f"{e.low}-{e.high}"
            candidate = (f"  candidate {setting_name(method, e.candidate.decoding_length)}: "
                         f"{e.candidate.tokens_per_step:.3f} tok/step, {e.candidate.speedup:.3f}x, drafted where "
                         "measured to pay" if e.candidate is not None else "")
            last = (f"  ({'candidate ' if e.candidate is not None else ''}{e.speedups[-1]:.3f}x at {e.high})"
                    if e.high > e.low and e.speedups else "")
            lines.append(f"  {span:>9} {setting:>10} {e.tokens_per_step:>9.3f} {e.tokens_per_second:>8.1f} "
                         f"{e.speedup:>7.3f}{candidate}{last}")
        covered = table.up_to_context or covered
    return "\n".join(lines)


def plot_schedule(plan: Plan, png: str | os.PathLike) -> None:
    """Predicted output tokens/s over the batch against batch size, per setting, and the schedule's envelope."""
    rates = Fields(plan.solver, f"{plan.source}: solver").sub("schedule").data.get("tokens_per_second") or {}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    batches = None
    for name, values in rates.items():
        batches = np.arange(1, len(values) + 1)
        points = np.array([np.nan if v is None else v for v in values], dtype=float)
        ax.plot(batches, points, linestyle="--" if name == "off" else "-", linewidth=1, label=name)
    if batches is not None:
        envelope = [max(v[b - 1] for v in rates.values() if v[b - 1] is not None) for b in batches]
        ax.plot(batches, envelope, color="black", linewidth=2.5, alpha=0.5, label="schedule")
    ax.set_xlabel("batch size (sequences per step)")
    ax.set_ylabel("predicted output tokens/s over the batch")
    ax.set_title(f"{plan.models.target} ({plan.models.dtype}): {plan.method} schedule", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    save_png(fig, png)


PLOT_MAX_TREE_SIZE = 4096


def _recorded_acceptance(plan: Plan, required: bool) -> list[float] | None:
    """The positional acceptance vector a Sequoia plan records among its inputs."""
    inputs = Fields(plan.inputs, f"{plan.source}: inputs")
    acceptance = inputs.sub("acceptance", required=required)
    return acceptance.number_list("positional", required=required, low=0.0, high=1.0) if acceptance else None


def plot_plan(plan: Plan, png: str | os.PathLike) -> None:
    if plan.schedule is not None:
        plot_schedule(plan, png)
        return
    if plan.method != "sequoia":
        raise UserError(f"--plot is not available for {plan.kind}")
    from specplan.planner.sequoia import SequoiaTables, rank_candidates
    positional = np.asarray(_recorded_acceptance(plan, required=True))
    inputs = Fields(plan.inputs, f"{plan.source}: inputs")
    # The DP is redrawn over the plan's own search space, bounded so that a file cannot ask for hours of it.
    max_size = inputs.integer("max_size", low=plan.tree.size, high=PLOT_MAX_TREE_SIZE)
    tables = SequoiaTables(positional, max_size, inputs.integer("max_depth", low=plan.tree.depth, high=max_size))
    G = tables.G
    plt = pyplot()
    profile_inputs = plan.inputs.get("profile")
    fig, axes = plt.subplots(1, 2 if profile_inputs else 1, figsize=(12 if profile_inputs else 7, 4.5), squeeze=False)
    ax = axes[0, 0]
    sizes = np.arange(1, G.shape[0])
    for d in sorted({int(x) for x in np.linspace(1, tables.max_depth, min(tables.max_depth, 8))} - {0}):
        ax.plot(sizes, G[1:, d], label=f"d = {d}")
    ax.scatter([plan.tree.size], [plan.prediction.tokens_per_step], color="black", zorder=5,
               label=f"plan: n={plan.tree.size}, d={plan.tree.depth}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree size n (nodes, root included)")
    ax.set_ylabel("G(n, d): expected tokens per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if profile_inputs:
        recorded = inputs.sub("profile")
        profile = LatencyProfile.from_dict({
            "kind": "profile/latency",
            "target": {"t_seconds": recorded.data.get("target_t_seconds")},
            "draft": {"step_seconds": recorded.data.get("draft_step_seconds")},
        }, recorded.where)
        prefill = plan.prediction.details.get("draft_prefill_seconds_per_token")
        ranked = rank_candidates(tables, profile,
                                 prefill_per_token=float(prefill) if isinstance(prefill, (int, float)) else 0.0)
        best_per_n: dict[int, float] = {}
        for c in ranked:
            best_per_n[c.size] = max(best_per_n.get(c.size, 0.0), c.speedup)
        ax2 = axes[0, 1]
        ns = sorted(best_per_n)
        ax2.plot(ns, [best_per_n[n] for n in ns], label="best depth for each n")
        if plan.prediction.speedup is not None:
            ax2.scatter([plan.tree.size], [plan.prediction.speedup], color="black", zorder=5, label="plan")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("tree size n")
        ax2.set_ylabel("predicted speedup")
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3)
    fig.suptitle(f"{plan.kind}: {plan.models.target or '?'} / {plan.models.draft or '?'}")
    fig.tight_layout()
    save_png(fig, png)
