"""Identity under load on real models: requests of different prompt lengths and finish times, some joining as
others leave, decoded by the continuous-batching scheduler; every request's greedy fp32 tokens against its own
one-request greedy tokens and transformers' greedy tokens.

    .venv/bin/python bench/batched_identity.py                  # every method below
    .venv/bin/python bench/batched_identity.py one-token lookahead

Methods: one-token and Lookahead on smollm2-135m (8 Spec-Bench requests, 4 in flight), Sequoia on the qwen pair
(8 requests, 4 in flight), TriForce with the shipped smollm2 8K plan (4 long-context requests, 2 in flight).
"""

from __future__ import annotations

import sys
import time

import torch

from specplan.core.prompts import encode_prompt
from specplan.decoder.api import load_decoder
from specplan.decoder.batching import Request
from specplan.decoder.sampling import SamplingParams
from specplan.profiler.datasets import read_dataset, spread_sample
from specplan.profiler.haystack import build_prompts

METHODS = {  # name: (plan or None, target, requests, in flight, long-context prompts)
    "one-token": (None, "smollm2-135m", 8, 4, False),
    "lookahead": ("plans/smollm2-135m.lookahead.cpu-2c.fp32.yaml", None, 8, 4, False),
    "sequoia": ("plans/qwen2.5-coder-1.5b.sequoia.cpu-2c.fp32.yaml", None, 8, 4, False),
    "triforce": ("plans/smollm2-135m.triforce-7680.cpu-2c-avx2.fp32.yaml", None, 4, 2, True),
}


def transformers_greedy(decoder, ids: list[int], max_new_tokens: int) -> list[int]:
    model = decoder.target.transformers_model()
    inputs = torch.tensor([ids])
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=decoder.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def check(name: str) -> bool:
    plan, target, count, concurrency, long_context = METHODS[name]
    decoder = load_decoder(plan, target=target, dtype="fp32", device="cpu")
    if long_context:
        prompts = [build_prompts("haystack", decoder.tokenizer, 6800 + 200 * i, 1, seed=i)[0].ids
                   for i in range(count)]
    else:
        texts = [p.text for p in spread_sample(read_dataset("specbench"), count)]
        prompts = [encode_prompt(decoder.tokenizer, text, True) for text in texts]
    budgets = [24 + 8 * (i % 4) for i in range(count)]  # different finish times
    requests = [Request(ids, budget) for ids, budget in zip(prompts, budgets)]
    start = time.perf_counter()
    batched = {c.id: c.result.tokens for c in decoder.generate_many(requests, concurrency)}
    wall = time.perf_counter() - start
    ok = True
    for i, request in enumerate(requests):
        decoder.restart()
        alone = decoder.generate(request.prompt, request.max_new_tokens, SamplingParams()).result.tokens
        reference = transformers_greedy(decoder, request.prompt, request.max_new_tokens)
        same = batched[i] == alone == reference
        ok &= same
        print(f"{name} request {i} ({len(request.prompt)} prompt tokens, {request.max_new_tokens} new): batched "
              f"{'==' if batched[i] == alone else '!='} alone, alone {'==' if alone == reference else '!='} "
              "transformers", flush=True)
    print(f"{name}: {count} requests, {concurrency} in flight, batched in {wall:.1f} s: "
          f"{'every request identical' if ok else 'MISMATCH'}", flush=True)
    return ok


if __name__ == "__main__":
    torch.set_num_threads(2)
    names = sys.argv[1:] or list(METHODS)
    results = [check(name) for name in names]
    sys.exit(0 if all(results) else 1)
