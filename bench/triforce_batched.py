"""TriForce under concurrency: the hierarchy's rounds in step across the sequences in flight (one middle forward
for all of them per round) against each sequence drafting alone (its own middle forwards), same plan, same requests,
interleaved; greedy, so both must give the same tokens.

    .venv/bin/python bench/triforce_batched.py plans/smollm2-135m.triforce-7680.cpu-2c-avx2.fp32.yaml \
        --requests 4 --concurrency 4 --rounds 2

Prints per run the wall time, the prefill seconds (each long prompt is prefilled alone as it is admitted) and the
aggregate decoding throughput: all output tokens over the wall time less the prefills.
"""

from __future__ import annotations

import argparse
import time

import torch

from specplan.decoder.api import load_decoder
from specplan.decoder.batching import Request
from specplan.decoder.triforce import HierarchicalDrafter
from specplan.profiler.haystack import build_prompts


def run(decoder, requests: list[Request], concurrency: int, in_step: bool) -> tuple[dict[int, list[int]], str]:
    original = HierarchicalDrafter.batches_with
    if not in_step:
        HierarchicalDrafter.batches_with = lambda self, other: False  # each sequence proposes alone
    try:
        start = time.perf_counter()
        completions = list(decoder.generate_many(requests, concurrency))
        wall = time.perf_counter() - start
    finally:
        HierarchicalDrafter.batches_with = original
    tokens = {c.id: c.result.tokens for c in completions}
    prefill = sum(c.result.prefill_seconds for c in completions)
    count = sum(len(t) for t in tokens.values())
    steps = sum(c.result.steps for c in completions)
    line = (f"{'in step' if in_step else 'alone  '}: {count} tokens in {wall:.1f} s ({prefill:.1f} s prefill), "
            f"{count / (wall - prefill):.2f} tokens/s decoding, {count / steps:.2f} tokens/step")
    return tokens, line


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    decoder = load_decoder(args.plan, dtype="fp32", device="cpu")
    prompts = [build_prompts("haystack", decoder.tokenizer, 6800 + 200 * i, 1, seed=i)[0].ids
               for i in range(args.requests)]
    requests = [Request(ids, args.max_new_tokens) for ids in prompts]
    reference = None
    for round_ in range(args.rounds):
        for in_step in ((True, False) if round_ % 2 == 0 else (False, True)):
            decoder.restart()
            tokens, line = run(decoder, requests, args.concurrency, in_step)
            reference = reference or tokens
            print(f"round {round_} {line}; {'same tokens' if tokens == reference else 'DIFFERENT TOKENS'}",
                  flush=True)


if __name__ == "__main__":
    main()
