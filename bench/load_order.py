"""Two identical one-token decoders of one model, loaded one after the other into one process, each serving the same
requests at C in flight in alternating order (`load_in_process.run`): whether a model's speed in this process depends
on when its weights were loaded, the bias `bench/load_in_process.py` carries (it loads the plan's decoder first).

    .venv/bin/python bench/load_order.py --target smollm2-135m --dtype fp32 --concurrency 8 \
        --dataset specbench:qa,math_reasoning,translation,extraction --no-chat --prompts 16 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics

import torch
from load_in_process import run

from specplan.core.prompts import encode_prompt
from specplan.decoder.api import load_decoder
from specplan.profiler.datasets import read_dataset, spread_sample


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--dataset", default="specbench:qa,math_reasoning,translation,extraction")
    parser.add_argument("--no-chat", action="store_true")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(2)
    decoders = {name: load_decoder(None, target=args.target, dtype=args.dtype, device="cpu")
                for name in ("loaded first", "loaded second")}
    tokenizer = decoders["loaded first"].tokenizer
    prompts = [encode_prompt(tokenizer, p.text, not args.no_chat)
               for p in spread_sample(read_dataset(args.dataset), args.prompts)]
    rates: dict[str, list[float]] = {name: [] for name in decoders}
    for round_index in range(args.rounds):
        order = list(decoders) if round_index % 2 == 0 else list(reversed(decoders))
        for name in order:
            rates[name].append(run(decoders[name], prompts, args.concurrency, args.max_new_tokens)["tokens_per_second"])
        print(f"round {round_index + 1} ({order[0]} ran first): " + ", ".join(
            f"{name} {rates[name][-1]:.1f} tokens/s" for name in decoders), flush=True)
    means = {name: statistics.mean(values) for name, values in rates.items()}
    print(f"means: {', '.join(f'{name} {rate:.1f}' for name, rate in means.items())}; first / second "
          f"{means['loaded first'] / means['loaded second']:.3f}")


if __name__ == "__main__":
    main()
