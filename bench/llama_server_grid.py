"""llama-server's exported flags against a grid of its own settings, from `plan bench --concurrency ... --baselines
llama-server,llama-server-export,... [--llama-server-drafts ...] [--llama-server-ngrams ...]` runs: per concurrency,
each system's mean tokens/s over the runs and rounds (and their spread), the export / the best of the grid, and the
same with the systems that ran one identical server command pooled as one setting (an export is often one of the
grid's commands, llama-server's own no-draft one where nothing pays: two names, one setting, whose runs differ by the
VM's noise alone); every other system (ours) / the best of the grid; and where the plan is a draft model's chain
solved with --batches, each llama-server-draft-N against llama-server's no-draft command, measured and as the plan
predicted it (its schedule's K = N and off rates at B = C).

Commands as each level recorded them (`command`); for results written before, rebuilt from the system's name and
the plan (--plan, which an export needs).

    .venv/bin/python bench/llama_server_grid.py RUN.jsonl [RUN2.jsonl ...] [--plan PLAN.yaml]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

from specplan.core.errors import UserError
from specplan.core.plan_schema import Plan, load_plan
from specplan.serving import LevelResult, llama_server_flags, load_levels

EXPORT = "llama-server-export"


def is_llama_server(system: str) -> bool:
    return system.startswith("llama-server")


def server_command(level: LevelResult, plan: Plan | None) -> tuple[str, ...]:
    """The level's server command, or for results from before it was recorded, its flags rebuilt."""
    if level.command is not None:
        return tuple(level.command)
    flags = llama_server_flags(level.system, "DRAFT.gguf", plan)
    return tuple(flags(level.concurrency) if callable(flags) else flags)


def summary(levels: list[LevelResult], plan: Plan | None) -> list[str]:
    """One line per concurrency (the module's doc)."""
    rates: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    pooled: dict[int, dict[tuple[str, ...], list[float]]] = defaultdict(lambda: defaultdict(list))
    names: dict[int, dict[tuple[str, ...], set[str]]] = defaultdict(lambda: defaultdict(set))
    for level in levels:
        rates[level.concurrency][level.system].append(level.tokens_per_second)
        if is_llama_server(level.system):
            command = server_command(level, plan)
            pooled[level.concurrency][command].append(level.tokens_per_second)
            names[level.concurrency][command].add(level.system)
    lines = []
    for concurrency in sorted(rates):
        means = {system: statistics.mean(values) for system, values in rates[concurrency].items()}
        line = [f"C={concurrency:2d}"]
        for system, values in rates[concurrency].items():
            spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
            line.append(f"{system} {means[system]:.1f}{spread}")
        grid = {system: rate for system, rate in means.items() if is_llama_server(system) and system != EXPORT}
        if grid:
            best = max(grid, key=grid.get)
            if EXPORT in means:
                line.append(f"export / best {means[EXPORT] / grid[best]:.2f} ({best})")
            groups = {command: statistics.mean(values) for command, values in pooled[concurrency].items()}
            grid_groups = {command: rate for command, rate in groups.items()
                           if names[concurrency][command] - {EXPORT}}
            exported = [command for command, systems in names[concurrency].items() if EXPORT in systems]
            if exported and grid_groups:
                top = max(grid_groups, key=grid_groups.get)
                alike = " = ".join(sorted(names[concurrency][exported[0]]))
                line.append(f"pooled by command: export / best {groups[exported[0]] / grid_groups[top]:.2f} "
                            f"({alike}: {len(pooled[concurrency][exported[0]])} runs; best "
                            f"{' = '.join(sorted(names[concurrency][top]))})")
            for system in means:
                if not is_llama_server(system):
                    line.append(f"{system} / best {means[system] / grid[best]:.2f}")
        predicted = (plan.solver.get("schedule", {}).get("tokens_per_second", {}) if plan is not None else {})
        for system in means:
            draft = system.removeprefix("llama-server-draft-")
            rates_k = predicted.get(f"K={draft}") or []
            if draft.isdigit() and "llama-server" in means and concurrency <= len(rates_k) \
                    and rates_k[concurrency - 1] is not None:
                forecast = rates_k[concurrency - 1] / predicted["off"][concurrency - 1]
                line.append(f"{system} / llama-server {means[system] / means['llama-server']:.2f} "
                            f"(predicted {forecast:.2f})")
        lines.append("; ".join(line))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--plan", help="the plan whose export ran, for results without recorded commands")
    args = parser.parse_args()
    try:
        levels = [level for run in args.runs for level in load_levels(run)]
        lines = summary(levels, load_plan(args.plan) if args.plan else None)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
