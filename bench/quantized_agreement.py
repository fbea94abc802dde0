"""How often speculative greedy output equals one-token greedy output on a model whose logits depend on how many rows
a forward scores: GGUF K-quant blocks (Q4_K, Q6_K) take their input rounded to 8 bits (llama.cpp's Q8_K), so the
last-bit differences between attention over one row and over a tree's rows (another summation order) now and then
move an activation by a rounding step, and logits of the same text differ by a few hundredths (docs/design.md, "The
GGUF's own quantized weights"). The brief's "in bf16, report the match rate", for these models.

Decodes the prompts with the target alone (one token a step) and with the plan drafting every step, alone and with
`--concurrency` requests in flight; per prompt, whether the outputs are identical, the tokens they share before the
first difference, and the top-2 logit gap of the one-token run where they part.

    .venv/bin/python bench/quantized_agreement.py plans/qwen2.5-coder-1.5b.sequoia-v64k.cpu-2c.gguf.yaml \
        --dataset specbench:qa,math_reasoning,translation,extraction --no-chat --prompts 16 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specplan.core.plan_schema import load_plan
from specplan.core.prompts import encode_prompt
from specplan.decoder.api import Decoder, load_decoder
from specplan.decoder.batching import Request
from specplan.profiler.datasets import read_dataset, spread_sample


def decode(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int, concurrency: int) -> list[list[int]]:
    decoder.restart()
    done = {c.id: c.result.tokens for c in decoder.generate_many([Request(ids, max_new_tokens) for ids in prompts],
                                                                   concurrency)}
    return [done[i] for i in range(len(prompts))]


def top2_gap(decoder: Decoder, ids: list[int]) -> float:
    """The target's top-2 logit gap at the end of `ids`, scored one token at a time as one-token decoding scores it."""
    model = decoder.engine.target
    cache = model.cache_for(len(ids) + 1, "target")
    model.prefill(torch.tensor(ids[:-1]), cache, logits=False)
    logits = model.forward(torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]), cache, None)[0].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("--dataset", default="specbench:qa,math_reasoning,translation,extraction")
    parser.add_argument("--no-chat", action="store_true", help="raw prompts, without the chat template")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    plan = load_plan(args.plan)
    one_token = load_decoder(None, target=plan.models.target, dtype=plan.models.dtype, device="cpu")
    prompts = [encode_prompt(one_token.tokenizer, p.text, not args.no_chat)
               for p in spread_sample(read_dataset(args.dataset), args.prompts)]
    reference = decode(one_token, prompts, args.max_new_tokens, 1)
    speculative = load_decoder(args.plan, device="cpu")
    speculative.draft_every_step()
    for concurrency in (1, args.concurrency):
        outputs = decode(speculative, prompts, args.max_new_tokens, concurrency)
        shared, gaps = [], []
        for ids, ours, theirs in zip(prompts, outputs, reference):
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            shared.append(first / max(len(theirs), 1))
            if ours != theirs:
                gaps.append(top2_gap(one_token, ids + theirs[:first]))
        identical = sum(ours == theirs for ours, theirs in zip(outputs, reference))
        print(f"{args.plan} ({plan.models.dtype}), {len(prompts)} prompts x {args.max_new_tokens} tokens, drafting "
              f"every step, {concurrency} in flight: {identical} of {len(prompts)} identical to one-token decoding; "
              f"tokens before the first difference {statistics.mean(shared):.0%} on average; top-2 logit gaps "
              f"where they part: {', '.join(f'{g:.3g}' for g in sorted(gaps)) or '-'}", flush=True)


if __name__ == "__main__":
    main()
