"""A serving results file priced again with today's pricing (planner/closed_loop.py): each level of ours, ours-ar
and the fixed settings beside the load's price, on the prompts `plan bench --concurrency` sent (the same dataset,
count and chat template give the same prompts in the same order).

    .venv/bin/python bench/price_levels.py PLAN.yaml RESULTS.jsonl [RUN2.jsonl ...] --dataset specbench --prompts 32 \
        --max-new-tokens 64 [--context 7680 --one-document]

Each level is priced with the outputs as long as the server's (recorded since; before, every output at the max, unless
another run of the level recorded them), its slots' requests as the level sent them (its requests over its
concurrency), a Lookahead trie's yield replayed on the served prompts' own records where the plan was solved on them
all; beside it, the price the run recorded.
"""

from __future__ import annotations

import argparse

from specplan.core.models import load_model
from specplan.core.plan_schema import load_plan
from specplan.profiler.haystack import served_prompts
from specplan.serving import load_levels, prompts_at_level, serving_prices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("results", nargs="+", help="runs of one benchmark: a level without its outputs' lengths "
                                                    "takes those of the same level in another run (same prompts)")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--prompts", type=int, required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--no-chat", action="store_true")
    parser.add_argument("--context", type=int, help="long prompts built from --dataset, as plan bench --context")
    parser.add_argument("--one-document", action="store_true")
    args = parser.parse_args()
    plan = load_plan(args.plan)
    levels = [level for results in args.results for level in load_levels(results)]
    recorded = {level.concurrency: level.output_lengths for level in levels if level.output_lengths}
    settings = sorted({int(level.system.removeprefix("setting-")) for level in levels
                       if level.system.startswith("setting-")})
    tokenizer = load_model(plan.models.target, plan.models.dtype or "fp32").tokenizer
    prompts = served_prompts(args.dataset, tokenizer, args.prompts, not args.no_chat, args.context or None,
                             args.one_document)
    prices = {}  # requests per client -> the systems' prices (a slot's trie learns from that many requests)
    for level in sorted(levels, key=lambda level: (level.concurrency, level.system)):
        per_client = (level.requests + level.failed) // level.concurrency
        if per_client not in prices:
            prices[per_client], _ = serving_prices(plan, settings, args.max_new_tokens, per_client, print, prompts)
        price = prices[per_client].get(level.system)
        if price is None:
            continue
        sent = prompts_at_level(prompts, level.concurrency, per_client, level.round)
        lengths = level.output_lengths or recorded.get(level.concurrency)  # None: every output at the max
        predicted = price(sent, level.concurrency, args.max_new_tokens, None, lengths)
        again = ""
        if (measured := level.measured_steps) is not None:
            repriced = price(sent, level.concurrency, args.max_new_tokens, measured, lengths)
            again = f", x{level.tokens_per_second / repriced:.2f} at {measured}"
        recorded_price = (f"; recorded price {level.predicted_tokens_per_second:.1f}"
                          if level.predicted_tokens_per_second else "")
        print(f"C={level.concurrency:2d} {level.system:10s} {level.tokens_per_second:6.1f} tokens/s: "
              f"x{level.tokens_per_second / predicted:.2f} of its price ({predicted:.1f}){again}{recorded_price}")


if __name__ == "__main__":
    main()
