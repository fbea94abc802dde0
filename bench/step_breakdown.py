"""Where a decoding step's time goes, against what the profile predicts for its forwards.

Decodes a plan's prompts with the plan's decoder and with one-token decoding, and times every piece: the
target's forwards (for TriForce split into the top level, over the full cache, and the middle level, over the
retrieval cache), the drafter's host work (a Lookahead trie's retrieval and insertion; TriForce's bottom
drafter, retrieval-cache builds and inserts; a StreamingLLM draft's forwards), and the rest of the engine
(verification walk, masks, commits, Python). Each forward is also priced by the profile at its actual size
and cache length, so the gap between a plan's prediction and a measured speedup splits into "forwards slower
than profiled" and "time outside the forwards". The two take turns prompt by prompt, so that a drift of
the machine weighs on both alike. TriForce plans decode haystack prompts at the plan's context
(as `plan bench --context` builds them); other plans decode prompts of --dataset (as `plan bench` picks them).

    python bench/step_breakdown.py --plan plans/smollm2-135m.triforce-4096.cpu-2c.fp32.yaml \
        --profile profiles/smollm2-135m.cpu-2c.fp32.yaml --prompts 2 --max-new-tokens 256
    python bench/step_breakdown.py --plan plans/smollm2-135m.lookahead.cpu-2c.fp32.yaml \
        --profile profiles/smollm2-135m.cpu-2c-avx2.fp32.yaml \
        --dataset specbench:summarization,rag,coding --prompts 6 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

from specplan.core.profile_schema import load_profile
from specplan.core.prompts import encode_prompt
from specplan.decoder.api import Decoder, load_decoder
from specplan.decoder.drafters import TrieDrafter
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.triforce import StreamingDrafter
from specplan.profiler.datasets import read_dataset, spread_sample
from specplan.profiler.haystack import LongPrompt, build_prompts


class Ledger:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.profiled: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.rows: dict[str, int] = defaultdict(int)  # a forward's new tokens, summed over its calls
        self.on = False

    def wrap(self, owner: object, method: str, name: str | Callable[..., str],
             price: Callable[..., float] | None = None, rows: Callable[..., int] | None = None) -> None:
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            label = name(*args) if callable(name) else name
            started = time.perf_counter()
            result = original(*args, **kwargs)
            self.seconds[label] += time.perf_counter() - started
            self.calls[label] += 1
            if price is not None:
                self.profiled[label] += price(*args)
            if rows is not None:
                self.rows[label] += rows(*args)
            return result

        setattr(owner, method, timed)


class InstrumentedRun:
    """An engine whose decoding steps are timed piece by piece into a Ledger, from the drafter's reset (between
    prefill and decoding) to the end of each generation. Several runs may share a target model: each wraps its
    forward, and only the run that is decoding has its ledger on."""

    def __init__(self, engine: SpeculativeEngine, profile) -> None:
        self.engine = engine
        self.ledger = Ledger()
        self.decode_seconds = 0.0
        self.tokens = self.steps = 0
        self.armed = False
        target, drafter = engine.target, engine.drafter
        retrieval = getattr(drafter, "retrieval", None)

        def forward_label(tokens, positions, cache, *rest) -> str:
            if isinstance(drafter, StreamingDrafter) and cache is drafter.cache:
                return "streaming drafts"  # the target itself over its StreamingLLM cache
            if retrieval is None:
                return "target forwards"
            return "middle forwards" if cache is retrieval.cache else "top forwards"

        def forward_price(tokens, positions, cache, *rest) -> float:
            return float(profile.latency(int(tokens.shape[0]), int(cache.length)))

        ledger = self.ledger
        ledger.wrap(target, "forward", forward_label, forward_price, lambda tokens, *rest: int(tokens.shape[0]))
        if isinstance(drafter, StreamingDrafter) and drafter.model is not target:
            ledger.wrap(drafter.model, "forward", "streaming drafts",
                        lambda tokens, positions, cache, *rest: profile.draft_step(int(cache.length)))
        if retrieval is not None:
            ledger.wrap(retrieval, "build", "retrieval builds")
            ledger.wrap(retrieval, "insert", "retrieval inserts")
            for method in ("propose", "update", "extend", "rollback"):
                ledger.wrap(drafter.bottom, method, "bottom drafter")
        elif isinstance(drafter, TrieDrafter):
            for method in ("propose", "update"):
                ledger.wrap(drafter, method, "trie")
        reset = drafter.reset

        def start_ledger(*args) -> None:  # the engine resets its drafter between prefill and decoding
            reset(*args)
            ledger.on = self.armed

        drafter.reset = start_ledger

    def generate(self, ids: list[int], max_new_tokens: int) -> None:
        self.armed = False
        self.engine.generate(ids, 8, SamplingParams())  # warm: this prompt's first shapes
        self.armed = True
        result = self.engine.generate(ids, max_new_tokens, SamplingParams())
        self.ledger.on = False
        self.decode_seconds += result.decode_seconds
        self.tokens += len(result.tokens)
        self.steps += result.steps


def plan_with_prompts(doc: str, input_option: str, prompts: int) -> tuple[argparse.Namespace, Decoder, list]:
    """The diagnostics' command line: --plan, one input file, and the plan's prompts: haystack prompts at a
    TriForce plan's context (as `plan bench --context` builds them), else prompts of --dataset."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument(input_option, required=True)
    parser.add_argument("--dataset", default="haystack")
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    decoder = load_decoder(args.plan)
    if decoder.plan.method != "triforce":
        picked = spread_sample(read_dataset(args.dataset), args.prompts)
        encoded = [(p, encode_prompt(decoder.tokenizer, p.text, chat=True)) for p in picked]
        return args, decoder, [LongPrompt(p.id, p.category, ids, None, len(ids)) for p, ids in encoded]
    return args, decoder, build_prompts(args.dataset, decoder.tokenizer, decoder.plan.settings.context,
                                        args.prompts)


def main() -> None:
    args, decoder, picked = plan_with_prompts(__doc__, "--profile", 2)
    profile = load_profile(args.profile)
    runs = {decoder.plan.method: InstrumentedRun(decoder.engine, profile),
            "one token": InstrumentedRun(SpeculativeEngine(decoder.target_forward, None, decoder.engine.stop_ids),
                                         profile)}
    for prompt in picked:  # prompt by prompt, both methods: a drift of the machine falls on both alike
        for run in runs.values():
            run.generate(prompt.ids, args.max_new_tokens)
    for name, run in runs.items():
        ledger, total = run.ledger, run.decode_seconds
        print(f"{name}: {run.tokens} tokens in {run.steps} steps, {total:.2f} s decoding "
              f"({total / run.tokens * 1e3:.2f} ms/token)")
        timed = 0.0
        for label in sorted(ledger.seconds, key=lambda k: -ledger.seconds[k]):
            seconds = ledger.seconds[label]
            timed += seconds
            profiled = ledger.profiled.get(label)
            extra = f"  profile says {profiled:.2f} s ({seconds / profiled:.3f}x)" if profiled else ""
            if ledger.rows.get(label):
                extra += f", {ledger.rows[label] / ledger.calls[label]:.2f} rows a call"
            print(f"  {label:<18} {seconds:7.2f} s  {ledger.calls[label]:6d} calls  "
                  f"{seconds / total:6.1%}{extra}")
        print(f"  {'the rest':<18} {total - timed:7.2f} s  {'':6}        {(total - timed) / total:6.1%}  "
              f"({(total - timed) / run.steps * 1e3:.2f} ms per step)")


if __name__ == "__main__":
    main()
