"""A batched step of sequences at mixed contexts, measured, against the step a `--batches` profile predicts for it
(LatencyProfile.batch_latency: B x n rows, each sequence's attention over its own context).

    .venv/bin/python bench/batched_step.py profiles/smollm2-135m.cpu-2c-avx2.fp32.batched.yaml

For B = 4 and 8 and n = 1, 2, 4: B caches at contexts spread over the profile's range (not all equal), one
`forward_many` timed (median of interleaved repeats), printed beside the prediction and their ratio.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from timing import interleaved_medians

from specplan.core.profile_schema import load_profile
from specplan.decoder.api import load_decoder
from specplan.decoder.model import ForwardItem, causal_mask
from specplan.profiler.latency import random_cache

MIXED = (0.1, 0.35, 0.6, 0.95)  # the sequences' contexts, as fractions of the profiled range, repeated over B


def main(profile_path: str) -> None:
    profile = load_profile(profile_path)
    if not profile.target_batches:
        raise SystemExit(f"{profile_path} has no batched steps: profile with --batches")
    model = load_decoder(None, target=profile.models["target"], dtype=profile.dtype, device="cpu").target_forward
    low, high = min(profile.target_batches), max(profile.target_batches)
    calls, predicted = {}, {}
    with torch.inference_mode():
        for batch in (4, 8):
            contexts = [int(low + (high - low) * MIXED[i % len(MIXED)]) for i in range(batch)]
            caches = [random_cache(model, L, 8) for L in contexts]
            for n in (1, 2, 4):
                mask = [causal_mask(L, n, model.dtype, "cpu") if n > 1 else None for L in contexts]
                items = [ForwardItem(torch.randint(0, 1000, (n,)), torch.arange(L, L + n), cache, m)
                         for L, cache, m in zip(contexts, caches, mask)]
                key = f"B={batch} n={n} contexts {contexts}"
                calls[key] = partial(model.forward_many, items)
                predicted[key] = profile.batch_latency(batch, n, contexts)
        measured = interleaved_medians(calls, repeats=9, warmup=2)
    for key, seconds in measured.items():
        print(f"{key}: measured {seconds * 1e3:.1f} ms, predicted {predicted[key] * 1e3:.1f} ms, "
              f"predicted/measured {predicted[key] / seconds:.3f}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1])
