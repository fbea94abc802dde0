"""Backs `--draft-vocab` (decoder/model.py: LeanModel.limit_vocabulary; the plans' draft_vocab 65536): the draft step
with the whole output matrix against steps that score only the ids below K (plus the stop tokens), timed interleaved,
and the share of a bench report's target tokens that such a draft could propose at all.

    .venv/bin/python bench/draft_vocab.py --model qwen2.5-coder-0.5b --dtype bf16 --limits 65536,32768 \
        --report reports/qwen2.5-coder-1.5b.sequoia.bf16.40.json
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import interleaved_medians

from specplan.core.machine import cpu_info
from specplan.core.models import load_model
from specplan.decoder.model import LeanModel, causal_mask


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--limits", default="65536,32768")
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--report", help="a bench report whose HF greedy tokens give the coverage")
    args = parser.parse_args()
    loaded = load_model(args.model, args.dtype)
    limits = [int(x) for x in args.limits.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    models = {"all": LeanModel(loaded.model)}
    for limit in limits:
        models[f"< {limit}"] = LeanModel(loaded.model)
        models[f"< {limit}"].limit_vocabulary(limit, loaded.stop_token_ids)
    cache = models["all"].new_cache(args.context + max(sizes))
    cache.k.normal_(0, 0.1)
    cache.v.normal_(0, 0.1)
    cache.length = args.context
    calls = {}
    for name, model in models.items():
        for n in sizes:
            mask = causal_mask(args.context, n, model.dtype, model.device) if n > 1 else None
            calls[(name, n)] = (lambda model=model, n=n, mask=mask: model.forward(
                torch.arange(7, 7 + n), torch.arange(args.context, args.context + n), cache, mask))
    medians = interleaved_medians(calls, args.repeats)
    print(f"machine: {cpu_info()['cpu']}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.model} {args.dtype}, context {args.context}, median of {args.repeats} interleaved forwards")
    print("| draft scores | output rows | " + " | ".join(f"n = {n} ms" for n in sizes) + " | vs all |")
    print("|---|---|" + "---|" * len(sizes) + "---|")
    base = medians[("all", sizes[0])]
    for name, model in models.items():
        row = [medians[(name, n)] for n in sizes]
        print(f"| {name} | {model.lm_head.shape[0]} | " + " | ".join(f"{m * 1e3:.1f}" for m in row)
              + f" | {row[0] / base:.2f}x |")
    if args.report:
        rows = json.load(open(args.report))["per_prompt"]
        tokens = [t for row in rows for t in row["methods"]["hf"]["tokens"]]
        stops = loaded.stop_token_ids
        for limit in limits:
            covered = sum(t < limit or t in stops for t in tokens) / len(tokens)
            print(f"ids < {limit} (or stop tokens): {covered:.1%} of the {len(tokens)} HF greedy tokens in "
                  f"{args.report}")


if __name__ == "__main__":
    main()
