"""Greedy agreement between the methods of a `plan bench` report and one reference method of the same report,
for runs without `hf` (transformers' bf16 on a CPU without bf16 instructions is too slow to run at long
context). Per prompt: identical or not, the first differing token, and the target's top-2 logit gap there
(the lean model's, in the report's dtype, after the reference's tokens up to that point).

    .venv/bin/python bench/greedy_agreement.py --report reports/bench-8k-bf16-avx2.json --reference ours-ar \
        --dataset haystack --context 7680
"""

from __future__ import annotations

import argparse
import json

import torch

from core.models import load_model
from decoder.model import LeanModel
from profiler.haystack import build_prompts
from specplan.bench import first_difference


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--reference", default="ours-ar")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--context", type=int, required=True, help="the bench's --context")
    args = parser.parse_args()
    report = json.loads(open(args.report).read())
    loaded = load_model(report["models"]["target"], report["models"]["dtype"])
    lean = LeanModel(loaded.model)
    prompts = build_prompts(args.dataset, loaded.tokenizer, args.context, len(report["per_prompt"]))
    for prompt, row in zip(prompts, report["per_prompt"], strict=True):
        reference = row["methods"][args.reference]["tokens"]
        for name, entry in row["methods"].items():
            if name == args.reference:
                continue
            tokens = entry["tokens"]
            if tokens == reference:
                print(f"{row['id']}: {name} identical to {args.reference} ({len(tokens)} tokens)")
                continue
            first = first_difference(tokens, reference)
            ids = torch.tensor(prompt.ids + reference[:first])
            logits = lean.prefill(ids, lean.new_cache(len(ids))).float()
            top = torch.topk(logits, 2)
            gap = float(top.values[0] - top.values[1])
            print(f"{row['id']}: {name} differs from {args.reference} at token {first} "
                  f"(of {len(tokens)} / {len(reference)}); top-2 logit gap there {gap:.4f}, "
                  f"{args.reference} {reference[first] if first < len(reference) else 'stop'}, "
                  f"{name} {tokens[first] if first < len(tokens) else 'stop'}, top-2 ids {top.indices.tolist()}")


if __name__ == "__main__":
    main()
