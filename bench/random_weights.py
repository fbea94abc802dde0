"""A Hugging Face model directory with random weights drawn from a model's config.json, for timing a model whose
weights cannot be where the timing runs (a lent GPU takes 64 MiB per call): a forward's time does not depend on
the weights' values. The tokenizer and generation files beside the config are copied, so every loader takes it.

    python bench/random_weights.py ~/.cache/specplan/converted/qwen2.5-coder-1.5b /tmp/qwen-1.5b-random
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

BESIDE_CONFIG = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", type=Path, help="a directory holding config.json (and the tokenizer files)")
    parser.add_argument("output", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the weights are drawn (a GPU draws 1.5B in a second)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the stored weights' dtype (bf16: half the disk and load time of an 8B model)")
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.source)
    torch.manual_seed(0)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(args.output)
    for name in BESIDE_CONFIG:
        if (args.source / name).is_file():
            shutil.copy(args.source / name, args.output / name)
    (args.output / "RANDOM_WEIGHTS.json").write_text(json.dumps({"config_from": str(args.source)}) + "\n")
    print(f"wrote {args.output}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M random parameters")


if __name__ == "__main__":
    main()
