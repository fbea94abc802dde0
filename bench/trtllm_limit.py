"""TensorRT-LLM's limit of expanded nodes per level, what it costs: for an acceptance file, the best tree value
G(n, d) unconstrained, solved exactly under the limit (planner.sequoia.LevelLimitedTables), and the best the
earlier filter reached (the sizes whose unconstrained optimum keeps the limit).

    .venv/bin/python bench/trtllm_limit.py --acceptance ACCEPTANCE.yaml [--max-size 64]
"""

from __future__ import annotations

import argparse

import numpy as np

from core.acceptance_schema import load_sequoia_acceptance
from core.plan_schema import TokenTree
from planner.engines import TRTLLM_EAGLE_LAYERS, engine_rules
from planner.sequoia import SequoiaTables, engine_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--acceptance", required=True)
    parser.add_argument("--max-size", type=int, default=64)
    args = parser.parse_args()
    positional = load_sequoia_acceptance(args.acceptance).positional
    rules, depth = engine_rules("trtllm"), TRTLLM_EAGLE_LAYERS
    free = SequoiaTables(positional, args.max_size, depth)
    limited = engine_tables(positional, args.max_size, depth, rules)
    print(f"| n | G(n, {depth}) unconstrained | under the limit (exact) | the filter's best at most n nodes |")
    print("|---|---|---|---|")
    filtered = -np.inf
    for n in range(2, min(args.max_size, limited.G.shape[0] - 1) + 1):
        if rules.broken_rule(TokenTree.from_parents(list(free.tree(n, depth)))) is None:
            filtered = max(filtered, free.G[n, depth])
        if n % 8 == 0 or n == args.max_size:
            print(f"| {n} | {free.G[n, depth]:.4f} | {limited.G[n, depth]:.4f} | {filtered:.4f} |")


if __name__ == "__main__":
    main()
