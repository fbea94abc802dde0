"""What switching a schedule's setting between steps costs (issue 51): a Lookahead plan decoded with its decoding
length fixed at A, fixed at B, and alternating A, B, A, ... step by step (what a schedule does as requests join and
leave), interleaved over repeats. The switch's cost per step is the alternating run's time per step less the mean of
the two fixed runs' (each step's forward and trie walk cost what they cost at that length either way).

    .venv/bin/python bench/switching_cost.py plans/smollm2-135m.lookahead.cpu-2c-avx2.fp32.yaml 12 4 [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from specplan.core.plan_schema import load_plan
from specplan.core.prompts import encode_prompt
from specplan.decoder.api import load_decoder
from specplan.decoder.drafters import TrieDrafter
from specplan.decoder.sampling import SamplingParams
from specplan.profiler.datasets import read_dataset

PROMPTS = "specbench:summarization,rag,coding"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("a", type=int, help="one decoding length")
    parser.add_argument("b", type=int, help="the other")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    plan = load_plan(args.plan)
    decoder = load_decoder(args.plan, device="cpu")
    prompts = [encode_prompt(decoder.tokenizer, p.text, True) for p in read_dataset(PROMPTS)[:args.prompts]]
    schemes = {"fixed A": (args.a,), "fixed B": (args.b,), "alternating": (args.a, args.b)}
    per_step: dict[str, list[float]] = {name: [] for name in schemes}
    outputs: dict[str, list[list[int]]] = {}
    decoder.draft_every_step()  # the plan's setting at every step, no per-request decisions
    for _ in range(args.repeats):
        for name, lengths in schemes.items():  # interleaved: each repeat runs every scheme once
            decoder.restart()  # a fresh trie: each scheme learns the same prompts and outputs in the same order
            drafter = decoder.engine.drafter
            assert isinstance(drafter, TrieDrafter), "a Lookahead plan"
            if max(lengths) > drafter.max_tree_size:
                raise SystemExit(f"the plan's trie drafts trees of {drafter.max_tree_size} nodes at most")
            turn = iter(range(1 << 30))
            original = drafter.propose

            def propose(*call, drafter=drafter, lengths=lengths, turn=turn, original=original):
                drafter.decoding_length = lengths[next(turn) % len(lengths)]
                return original(*call)

            drafter.propose = propose
            seconds = steps = 0
            outputs[name] = []
            for ids in prompts:
                start = time.perf_counter()
                result = decoder.generate(ids, args.max_new_tokens, SamplingParams()).result
                seconds += time.perf_counter() - start
                steps += result.steps
                outputs[name].append(result.tokens)
            per_step[name].append(seconds / steps)
    assert outputs["alternating"] == outputs["fixed A"] == outputs["fixed B"], "greedy output must not change"
    medians = {name: statistics.median(times) for name, times in per_step.items()}
    fixed_mean = (medians["fixed A"] + medians["fixed B"]) / 2
    print(f"{plan.method} plan, decoding lengths {args.a} and {args.b}, {args.prompts} prompts x "
          f"{args.max_new_tokens} tokens, {args.repeats} interleaved repeats (median ms per step):")
    for name, value in medians.items():
        print(f"  {name:<12} {value * 1e3:8.2f}")
    print(f"  switching costs {(medians['alternating'] - fixed_mean) * 1e3:+.2f} ms per step "
          f"({medians['alternating'] / fixed_mean - 1:+.1%} of the fixed runs' mean)")


if __name__ == "__main__":
    main()
