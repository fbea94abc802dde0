"""What each serving engine's rules cost: from one acceptance file and one profile, the best plan every engine runs
(`plan solve sequoia --engine E`) beside the unconstrained tree, as a Markdown table (BENCHMARKS.md's engine table).

    .venv/bin/python bench/engine_plans.py --acceptance A.yaml --profile P.yaml [--max-size 64 --max-depth 12]
"""

from __future__ import annotations

import argparse

from specplan.core.choices import ENGINES
from specplan.planner.sequoia import solve_sequoia

HEADS = 4  # Medusa's and EAGLE-1's draft heads for the table: the depth a 4-head model drafts


def tree_shape(parents: tuple[int, ...]) -> str:
    depths = [0] * len(parents)
    for v in range(1, len(parents)):
        depths[v] = depths[parents[v]] + 1
    return "-".join(str(depths.count(level)) for level in range(1, max(depths) + 1)) or "root"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--acceptance", required=True)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--max-size", type=int, default=64)
    parser.add_argument("--max-depth", type=int, default=12)
    args = parser.parse_args()
    free, _ = solve_sequoia(args.acceptance, args.max_size, args.max_depth, args.profile)
    print(f"acceptance {args.acceptance}, profile {args.profile}, n <= {args.max_size}, d <= {args.max_depth}; "
          f"medusa and eagle1 with {HEADS} heads\n")
    print("| engine | rules | tree: n, d, nodes per level | tokens/step | predicted speedup | vs unconstrained |")
    print("|---|---|---|---|---|---|")
    for engine in ENGINES:
        plan, _ = solve_sequoia(args.acceptance, args.max_size, args.max_depth, args.profile, engine=engine,
                                heads=HEADS if engine in ("medusa", "eagle1") else None)
        limits = plan.solver.get("engine", {"shape": "tree"})
        rules = ", ".join(f"{k} {v}" for k, v in limits.items() if k not in ("name", "sources", "unconstrained"))
        tree = plan.tree
        print(f"| {engine} | {rules} | {tree.size}, {tree.depth}, {tree_shape(tree.parents)} | "
              f"{plan.prediction.tokens_per_step:.3f} | {plan.prediction.speedup:.3f}x | "
              f"{plan.prediction.speedup / free.prediction.speedup:.3f} |")


if __name__ == "__main__":
    main()
