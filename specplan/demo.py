"""`make demo`: the whole workflow on the embedded default (smollm2-135m) and the project's own prompts.

profile (quick) -> accept (the target's greedy outputs) -> solve lookahead -> generate with the plan next to
plain decoding, checking that the outputs are identical and timing both.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from specplan.core.errors import UserError
from specplan.core.plan_schema import save_plan
from specplan.core.prompts import encode_prompt
from specplan.decoder.api import load_decoder
from specplan.decoder.sampling import SamplingParams
from specplan.planner.lookahead import solve_lookahead
from specplan.profiler.datasets import DEMO_PROMPTS, read_dataset
from specplan.profiler.latency import QUICK_SIZES, ProfileRequest, run_profile
from specplan.profiler.outputs import run_lookahead_acceptance

MODEL = "smollm2-135m"
OUT = Path("demo-output")


def say(message: str) -> None:
    print(message, flush=True)


def main() -> int:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    OUT.mkdir(exist_ok=True)
    started = time.perf_counter()
    say(f"== 1/4 profile: t(n) of {MODEL} ({dtype}) on this CPU, quick grid")
    profile_path = OUT / f"{MODEL}.{dtype}.profile.yaml"
    request = ProfileRequest(target=MODEL, dtype=dtype, contexts=[256, 1024], sizes=list(QUICK_SIZES), repeats=3,
                             warmup=1)
    profile = run_profile(request, profile_path, log=say)
    curve = profile.target_by_context[256]
    say("   t(n) at 256 tokens of context: " + ", ".join(f"n={n}: {t * 1e3:.1f} ms" for n, t in curve.items()))

    say(f"== 2/4 accept: the target's own greedy outputs on {len(read_dataset(str(DEMO_PROMPTS)))} demo prompts")
    acceptance_path = OUT / f"{MODEL}.{dtype}.lookahead-outputs.yaml"
    run_lookahead_acceptance(MODEL, str(DEMO_PROMPTS), None, 128, dtype, True, str(acceptance_path),
                             log=lambda m: say("   " + m))

    say("== 3/4 solve: replay the trie offline over (L_d, L_b) and pick the fastest on this profile")
    plan, ranked = solve_lookahead(acceptance_path, profile_path)
    plan_path = Path("plans") / f"demo.{MODEL}.lookahead.{dtype}.yaml"
    save_plan(plan, plan_path)
    say(f"   chose L_d = {plan.settings.decoding_length}, L_b = {plan.settings.branch_length}: "
        f"{plan.prediction.tokens_per_step:.2f} tokens/step, predicted {plan.prediction.speedup:.2f}x "
        f"over autoregressive decoding ({plan_path})")

    say("== 4/4 generate: the Lookahead plan next to plain decoding (same engine, one-node trees) and "
        "transformers' greedy generate")
    decoder = load_decoder(plan_path)
    plain = load_decoder(None, target=MODEL, dtype=dtype)
    params = SamplingParams()
    totals = {"lookahead": [0, 0.0], "plain": [0, 0.0]}
    identical = 0
    prompts = read_dataset(str(DEMO_PROMPTS))
    transformers_model = decoder.target.transformers_model()  # its own copy of the weights, for the comparison
    decoder.generate(encode_prompt(decoder.tokenizer, prompts[0].text, True)[:32], 4, params)  # warm-up
    for prompt in prompts:
        ids = encode_prompt(decoder.tokenizer, prompt.text, True)
        fast = decoder.generate(ids, 128, params).result
        slow = plain.generate(ids, 128, params).result
        with torch.inference_mode():
            tensor = torch.tensor([ids])
            hf = transformers_model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=128,
                                             do_sample=False, pad_token_id=decoder.tokenizer.pad_token_id)
            hf = hf[0, len(ids):].tolist()
        same = fast.tokens == slow.tokens == hf
        identical += same
        for name, result in (("lookahead", fast), ("plain", slow)):
            totals[name][0] += len(result.tokens)
            totals[name][1] += result.decode_seconds
        say(f"   [{prompt.category:>13}] {len(fast.tokens):>3} tokens  lookahead {fast.tokens_per_second:6.1f} tok/s "
            f"({fast.tokens_per_step:.2f} tok/step)  plain {slow.tokens_per_second:6.1f} tok/s  "
            f"identical to HF greedy: {'yes' if same else 'NO'}")
    fast_rate = totals["lookahead"][0] / totals["lookahead"][1]
    slow_rate = totals["plain"][0] / totals["plain"][1]
    say(f"== lookahead {fast_rate:.1f} tok/s vs plain {slow_rate:.1f} tok/s: {fast_rate / slow_rate:.2f}x "
        f"(predicted {plan.prediction.speedup:.2f}x); outputs identical on {identical}/{len(prompts)} prompts; "
        f"demo took {time.perf_counter() - started:.0f} s")
    example = decoder.generate(prompts[2].text, 80, params, chat=True)
    say(f"\nexample ({prompts[2].category}):\n{example.text}")
    return 0 if identical == len(prompts) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        sys.exit(2)
