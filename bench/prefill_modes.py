"""Prefill on admission (the joining prompts together, before the next step) against chunked prefill (a joining
prompt's tokens riding along the decode steps, N a step): closed-loop clients in process, the Scheduler driven
directly, each mode's rounds interleaved.

    .venv/bin/python bench/prefill_modes.py smollm2-135m fp32 16 0,64,128 [rounds=2] [prompts=32] [tokens=64]

C clients (here 16) each submit their next Spec-Bench prompt (chat template) when their last completes, about 2C
requests a round. Per mode: aggregate output tokens/s (all output tokens over the wall time), time to first token
from submission (p50, p95) and time per output token after it (p50, p95), over every round.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from specplan.core.prompts import encode_prompt
from specplan.decoder.api import load_decoder
from specplan.decoder.batching import Request
from specplan.profiler.datasets import read_dataset, spread_sample


def closed_loop(decoder, prompts: list[list[int]], concurrency: int, chunk: int, max_new: int) -> dict:
    scheduler = decoder.scheduler(concurrency, chunk)
    queue = list(reversed(prompts))
    submitted, first, done, tokens = {}, {}, {}, {}

    def submit() -> None:
        prompt = queue.pop()
        request_id = scheduler.submit(Request(prompt, max_new, on_tokens=lambda _: None))
        submitted[request_id] = time.perf_counter()

    start = time.perf_counter()
    for _ in range(min(concurrency, len(queue))):
        submit()
    while not scheduler.idle:
        for completion in scheduler.step():
            now = time.perf_counter()
            tokens[completion.id] = len(completion.result.tokens)
            first[completion.id] = submitted[completion.id] + completion.first_token_seconds
            done[completion.id] = now
            if queue:
                submit()
    wall = time.perf_counter() - start
    for kept in decoder.target_forward.kept_caches.values():  # the next run starts without this one's prefixes
        for cache in kept.values():
            cache.reset()
    ttft = [first[i] - submitted[i] for i in done]
    tpot = [(done[i] - first[i]) / (tokens[i] - 1) for i in done if tokens[i] > 1]
    return {"tokens": sum(tokens.values()), "wall": wall, "ttft": ttft, "tpot": tpot}


def main(target: str, dtype: str, concurrency: str, chunks: str, *options: str) -> None:
    settings = {"rounds": 2, "prompts": 32, "tokens": 64} | {k: int(v) for k, v in (o.split("=") for o in options)}
    torch.set_num_threads(2)
    decoder = load_decoder(None, target=target, dtype=dtype, device="cpu")
    texts = [p.text for p in spread_sample(read_dataset("specbench"), settings["prompts"])]
    prompts = [encode_prompt(decoder.tokenizer, text, True) for text in texts]
    c = int(concurrency)
    level = [prompts[i % len(prompts)] for i in range(2 * c)]
    modes = [int(m) for m in chunks.split(",")]
    closed_loop(decoder, [p[::-1] for p in level[:c]], c, 0, 8)  # warm-up
    results = {m: [] for m in modes}
    for _ in range(settings["rounds"]):
        for mode in modes:
            results[mode].append(closed_loop(decoder, level, c, mode, settings["tokens"]))
    for mode, runs in results.items():
        ttft = np.concatenate([r["ttft"] for r in runs]) * 1e3
        tpot = np.concatenate([r["tpot"] for r in runs]) * 1e3
        rates = [r["tokens"] / r["wall"] for r in runs]
        name = "prefill on admission" if mode == 0 else f"chunked prefill {mode}"
        print(f"{target} {dtype} C={c} {name}: {', '.join(f'{r:.1f}' for r in rates)} tokens/s; "
              f"TTFT p50/p95 {np.percentile(ttft, 50):.0f}/{np.percentile(ttft, 95):.0f} ms; "
              f"TPOT p50/p95 {np.percentile(tpot, 50):.0f}/{np.percentile(tpot, 95):.0f} ms", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
