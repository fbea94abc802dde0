"""The decoder's speed at two checkouts of specplan, interleaved in one run: one-token and Lookahead decoding of
smollm2-135m in fp32 and in the shipped GGUF (Q4_1), decode tokens/s over the same prompts, each (checkout, setting)
in a fresh process, the two checkouts alternating round by round (the first one first on even rounds) so that the
machine's drift hits both alike. Also checks that both emit the same tokens.

    .venv/bin/python bench/before_after.py /tmp/old . --rounds 4 --prompts 8 --max-new-tokens 128

A checkout of the layout before `specplan.` held every package (top-level core/, decoder/) is run from its folder;
one of today's layout must be the one installed in this environment (`pip install -e`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SETTINGS = {  # name: (dtype, plan file or None for one-token decoding)
    "one-token fp32": ("fp32", None),
    "Lookahead fp32": ("fp32", "plans/smollm2-135m.lookahead.cpu-2c.fp32.yaml"),
    "one-token Q4_1": ("gguf", None),
    "Lookahead Q4_1": ("gguf", "plans/smollm2-135m.lookahead.cpu-2c.gguf.yaml"),
}

# Runs inside the checkout: decode the prompts, print {"tokens": [...], "seconds": decode seconds}.
RUN = """
import json, sys, torch
torch.set_num_threads(2)
try:
    from specplan import load_decoder
except ImportError:
    from decoder.api import load_decoder
from specplan.profiler.datasets import read_dataset, spread_sample
dtype, plan, count, new = sys.argv[1], sys.argv[2] or None, int(sys.argv[3]), int(sys.argv[4])
decoder = load_decoder(plan, target="smollm2-135m", dtype=dtype)
prompts = spread_sample(read_dataset("specbench:summarization,rag,coding"), count)
decoder.generate(prompts[0].text, 8, chat=True)  # warm-up
outputs, seconds = [], 0.0
for prompt in prompts:
    decoder.restart()
    out = decoder.generate(prompt.text, new, chat=True)
    outputs.append(out.result.tokens)
    seconds += out.result.decode_seconds
print(json.dumps({"tokens": outputs, "seconds": seconds}))
"""
OLD_RUN = RUN.replace("from specplan.profiler.datasets", "from profiler.datasets")


def old_layout(checkout: Path) -> bool:
    return (checkout / "core" / "__init__.py").is_file() and "from core" in (checkout / "specplan" / "__init__.py"
                                                                               ).read_text()


def run(checkout: Path, dtype: str, plan: str | None, prompts: int, new_tokens: int) -> dict:
    old = old_layout(checkout)
    env = {**os.environ, "PYTHONPATH": str(checkout)} if old else dict(os.environ)
    result = subprocess.run([sys.executable, "-c", OLD_RUN if old else RUN, dtype, plan or "", str(prompts),
                             str(new_tokens)], cwd=checkout, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    names = args.settings.split(",")
    rates: dict[tuple[str, str], list[float]] = {(s, c): [] for s in names for c in checkouts}
    same = {s: True for s in names}
    for round_ in range(args.rounds):
        order = list(checkouts) if round_ % 2 == 0 else list(reversed(checkouts))
        for setting in names:
            dtype, plan = SETTINGS[setting]
            outputs = {}
            for which in order:
                measured = run(checkouts[which], dtype, plan, args.prompts, args.max_new_tokens)
                outputs[which] = measured["tokens"]
                tokens = sum(len(t) for t in measured["tokens"])
                rates[(setting, which)].append(tokens / measured["seconds"])
            same[setting] &= outputs["before"] == outputs["after"]
            print(f"round {round_ + 1} {setting}: " + ", ".join(
                f"{which} {rates[(setting, which)][-1]:.1f} tok/s" for which in order), flush=True)
    print(f"\n{args.before} -> {args.after}: decode tokens/s, median of {args.rounds} rounds (each a fresh process)")
    print("| setting | before | after | after / before | rounds after/before (min-max) | same tokens |")
    print("|---|---|---|---|---|---|")
    for setting in names:
        before, after = rates[(setting, "before")], rates[(setting, "after")]
        ratios = [a / b for a, b in zip(after, before)]
        print(f"| {setting} | {statistics.median(before):.1f} | {statistics.median(after):.1f} | "
              f"{statistics.median(after) / statistics.median(before):.3f} | {min(ratios):.3f}-{max(ratios):.3f} | "
              f"{'yes' if same[setting] else 'NO'} |")


if __name__ == "__main__":
    main()
