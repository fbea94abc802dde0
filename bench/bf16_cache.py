"""One forward of the lean model at a few contexts and row counts: fp32, bf16 with a bf16 KV cache (bf16
attention) and bf16 with an fp32 KV cache (fp32 attention, the default on CPUs without bf16 instructions),
interleaved per repeat; the median per point. Then a bf16 prefill with matmuls of UPCAST_ROWS rows or more in
fp32 (the default on such CPUs) against one with every matmul in bf16.

    .venv/bin/python bench/bf16_cache.py --model smollm2-135m --contexts 256,4096,7680 --rows 1,4,8,16,64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import decoder.model as model_module
from core.machine import cpu_info
from core.models import load_model
from decoder.model import LeanModel, causal_mask


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--contexts", default="256,4096,7680")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefill", type=int, default=2048, help="prompt tokens to prefill (0: skip)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = [int(r) for r in args.rows.split(",")]
    variants = {"fp32": (LeanModel(load_model(args.model, "fp32").model), torch.float32)}
    bf16 = LeanModel(load_model(args.model, "bf16").model)
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    variants["bf16, bf16 cache"] = (bf16, torch.bfloat16)
    variants["bf16, fp32 cache"] = (bf16, torch.float32)
    print(f"machine: {cpu_info()['cpu']} ({', '.join(cpu_info()['cpu_flags'])}), {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, bf16 instructions: {native} (default bf16 cache: "
          f"{'bf16' if bf16.cache_dtype == torch.bfloat16 else 'fp32'}); {args.model}, median of {args.repeats} ms")
    print("| context | rows | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    default_cache = bf16.cache_dtype
    for context in contexts:
        caches = {}
        for name, (lean, cache_dtype) in variants.items():
            lean.cache_dtype = cache_dtype
            caches[name] = lean.new_cache(context + max(sizes))
            caches[name].k.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
            caches[name].v.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
            caches[name].length = context
        for rows in sizes:
            tokens, positions = torch.arange(100, 100 + rows), torch.arange(context, context + rows)
            seconds: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeats + 1):
                for name, (lean, cache_dtype) in variants.items():
                    lean.cache_dtype = cache_dtype  # the two bf16 variants share one model
                    mask = causal_mask(context, rows, lean.dtype, "cpu") if rows > 1 else None
                    start = time.perf_counter()
                    lean.forward(tokens, positions, caches[name], mask)
                    seconds[name].append(time.perf_counter() - start)
            medians = [statistics.median(s[1:]) * 1e3 for s in seconds.values()]
            print(f"| {context} | {rows} | " + " | ".join(f"{m:.1f}" for m in medians) + " |")
    bf16.cache_dtype = default_cache
    if args.prefill and bf16.emulated_bf16:
        ids = torch.randint(0, bf16.shape.vocab, (args.prefill,), generator=torch.Generator().manual_seed(2))
        upcast = model_module.UPCAST_ROWS
        for label, rows in ((f"matmuls of {upcast}+ rows in fp32", upcast), ("every matmul in bf16", None)):
            bf16.upcast_rows = rows or args.prefill + 1
            start = time.perf_counter()
            bf16.prefill(ids, bf16.new_cache(args.prefill), logits=False)
            print(f"bf16 prefill of {args.prefill} tokens, {label}: {time.perf_counter() - start:.1f} s")
        bf16.upcast_rows = model_module.UPCAST_ROWS


if __name__ == "__main__":
    main()
