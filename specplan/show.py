"""`plan show`: readable views (and plots) of plans, profiles and acceptance files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from specplan.errors import UserError
from specplan.fileio import atomic_output, read_yaml
from specplan.plan_schema import Plan, TokenTree


def show_file(path: str | os.PathLike, plot: str | os.PathLike | None = None) -> str:
    data = read_yaml(path)
    kind = data.get("kind")
    if isinstance(kind, str) and kind.startswith("plan/"):
        plan = Plan.from_dict(data, str(path))
        text = describe_plan(plan)
        if plot is not None:
            plot_plan(plan, plot)
        return text
    raise UserError(f"{path}: cannot show a document of kind {kind!r}")


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


def describe_plan(plan: Plan) -> str:
    lines = [f"{plan.kind}  models: " + ", ".join(f"{k}={v}" for k, v in plan.models.items())]
    if plan.sampling:
        lines.append("sampling: " + ", ".join(f"{k}={v}" for k, v in plan.sampling.items()))
    lines.append("prediction:")
    lines.extend(_format_mapping(plan.prediction))
    if plan.tree is not None:
        depths = plan.tree.depths
        widths = [depths.count(k) for k in range(plan.tree.depth + 1)]
        lines.append(f"tree: {plan.tree.size} nodes, depth {plan.tree.depth}, nodes per level {widths}")
        positional = plan.inputs.get("acceptance", {}).get("positional")
        lines.extend("  " + line for line in ascii_tree(plan.tree, positional))
    lines.append("inputs:")
    lines.extend(_format_mapping(plan.inputs))
    lines.append("solver:")
    lines.extend(_format_mapping({k: v for k, v in plan.solver.items() if k != "top"}))
    lines.append("provenance:")
    lines.extend(_format_mapping(plan.provenance))
    return "\n".join(lines)


def plot_plan(plan: Plan, png: str | os.PathLike) -> None:
    if plan.method != "sequoia":
        raise UserError(f"--plot is not available for {plan.kind}")
    from planner.sequoia import rank_candidates
    from planner.sequoia_dp import SequoiaTables
    from specplan.profile_schema import LatencyProfile

    positional = np.asarray(plan.inputs["acceptance"]["positional"])
    tables = SequoiaTables(positional, int(plan.inputs["max_size"]), int(plan.inputs["max_depth"]))
    G = tables.G
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile_inputs = plan.inputs.get("profile")
    fig, axes = plt.subplots(1, 2 if profile_inputs else 1, figsize=(12 if profile_inputs else 7, 4.5), squeeze=False)
    ax = axes[0, 0]
    sizes = np.arange(1, G.shape[0])
    for d in sorted({int(x) for x in np.linspace(1, tables.max_depth, min(tables.max_depth, 8))} - {0}):
        ax.plot(sizes, G[1:, d], label=f"d = {d}")
    ax.scatter([plan.tree.size], [plan.prediction["tokens_per_step"]], color="black", zorder=5,
               label=f"plan: n={plan.tree.size}, d={plan.tree.depth}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree size n (nodes, root included)")
    ax.set_ylabel("G(n, d): expected tokens per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if profile_inputs:
        profile = LatencyProfile.from_dict({
            "kind": "profile/latency",
            "target": {"t_seconds": profile_inputs["target_t_seconds"]},
            "draft": {"step_seconds": profile_inputs["draft_step_seconds"]},
        }, "plan inputs")
        ranked = rank_candidates(tables, profile, int(plan.inputs.get("batch", 1)))
        best_per_n: dict[int, float] = {}
        for c in ranked:
            best_per_n[c.size] = max(best_per_n.get(c.size, 0.0), c.speedup)
        ax2 = axes[0, 1]
        ns = sorted(best_per_n)
        ax2.plot(ns, [best_per_n[n] for n in ns], label="best depth for each n")
        ax2.scatter([plan.tree.size], [plan.prediction["speedup"]], color="black", zorder=5, label="plan")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("tree size n")
        ax2.set_ylabel("predicted speedup")
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3)
    fig.suptitle(f"{plan.kind}: {plan.models.get('target', '?')} / {plan.models.get('draft', '?')}")
    fig.tight_layout()
    with atomic_output(Path(png), "wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    plt.close(fig)
