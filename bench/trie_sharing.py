"""Lookahead under concurrency: a trie per slot (each learns from its own slot's outputs; with one slot, the
offline replay) against one trie shared by every slot (every output teaches it; the Ant reference's design), on
the same requests: tokens per step (what the trie's drafts are worth) and decode tokens/s, side by side.

    .venv/bin/python bench/trie_sharing.py plans/smollm2-135m.lookahead.cpu-2c.fp32.yaml --prompts 24 --concurrency 4
"""

from __future__ import annotations

import argparse
import time

import torch

from specplan.core.prompts import encode_prompt
from specplan.decoder.api import load_decoder
from specplan.decoder.batching import Request
from specplan.decoder.drafters import TrieDrafter
from specplan.decoder.trie import Trie
from specplan.profiler.datasets import read_dataset, spread_sample


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    decoder = load_decoder(args.plan, device="cpu")
    settings = decoder.plan.settings.check()
    texts = [p.text for p in spread_sample(read_dataset("specbench"), args.prompts)]
    requests = [Request(encode_prompt(decoder.tokenizer, t, True), args.max_new_tokens) for t in texts]

    def private() -> None:
        decoder.make_drafter = lambda: TrieDrafter(Trie(settings))

    def shared() -> None:
        trie = Trie(settings)
        decoder.make_drafter = lambda: TrieDrafter(trie, shared=True)

    for round_ in range(args.rounds):
        for name, setup in (("private", private), ("shared", shared))[::1 if round_ % 2 == 0 else -1]:
            setup()
            decoder.restart()
            start = time.perf_counter()
            done = list(decoder.generate_many(requests, args.concurrency))
            wall = time.perf_counter() - start
            tokens = sum(len(c.result.tokens) for c in done)
            steps = sum(c.result.steps for c in done)
            print(f"round {round_} {name:8s} concurrency {args.concurrency}: {tokens / steps:.3f} tokens/step, "
                  f"{tokens / wall:.1f} tokens/s ({tokens} tokens, {wall:.1f} s)", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
