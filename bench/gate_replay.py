"""Do the per-request drafting decisions take the drafts that pay? (issue 51, Deliver 4; decoder/gate.py)

A plan decodes the prompts one at a time, in order, twice: with its per-request decisions and drafting at every
step. Both runs' steps are priced on the plan's own batch-1 prediction: a drafted step costs tokens per step / speedup
plain steps, the very price the decisions hold a request's drafts to, a step whose drafter proposed nothing one plain
step; one-token decoding costs one plain step a token. The greedy tokens are the same in every run (in fp32 and on
fp32-input GGUF blocks; on K-quants the match rate is printed) and the decisions follow from them alone, so no clock
is read: the priced speedups say how much of what drafting can gain on these
prompts the decisions keep, on the price they are given (whether that price holds on the machine is another question).
`--step-cost N` gives both the decisions and the pricing a drafted step of N plain steps instead, as a served step
log measured it (bench/step_log.py: its "measured ratio").

    .venv/bin/python bench/gate_replay.py plans/smollm2-135m.lookahead.cpu-2c.fp32.batched.yaml \
        --dataset specbench:summarization,rag,coding --prompts 16 --max-new-tokens 64 [--no-chat]
    .venv/bin/python bench/gate_replay.py plans/smollm2-135m.triforce-7680.cpu-2c-amx.fp32.batched.yaml \
        --dataset specbench:summarization,rag --context 7680 --one-document --max-new-tokens 128 --step-cost 5.6
"""

from __future__ import annotations

import argparse
import statistics

from specplan.core.plan_schema import Plan, load_plan
from specplan.decoder.api import Decoder, load_decoder
from specplan.decoder.batching import Request
from specplan.profiler.haystack import served_prompts


def priced_run(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int, plan: Plan,
               step_cost: float | None = None) -> dict[str, float | list]:
    """Decode the prompts one at a time in order, as a server's one slot does (a fresh drafter state first, each
    prompt's prefix shared with the last one's kept); the run's priced speedup over one-token decoding, a drafted
    step at `step_cost` plain steps (default: the plan's price)."""
    decoder.restart()
    tokens = plain_steps = drafted_steps = emitted_drafted = 0
    priced = 0.0
    outputs = []
    completions = {c.id: c.result for c in decoder.generate_many([Request(ids, max_new_tokens) for ids in prompts], 1)}
    for place, ids in enumerate(prompts):
        result = completions[place]
        predicted = plan.predicted_at(1, len(ids))
        if predicted is None:
            raise SystemExit("the plan is off at batch size 1: nothing to decide")
        drafted_step_cost = step_cost or predicted[0] / predicted[1]
        for emitted, drafted in zip(result.accepted_per_step, result.drafted_per_step):
            if drafted:
                drafted_steps += 1
                emitted_drafted += emitted
                priced += drafted_step_cost
            else:
                plain_steps += 1
                priced += 1.0
        tokens += len(result.tokens)
        outputs.append(result.tokens)
    return {"speedup": tokens / priced, "drafted": drafted_steps / (drafted_steps + plain_steps),
            "per_drafted_step": emitted_drafted / max(drafted_steps, 1), "tokens": tokens, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("--dataset", default="specbench:summarization,rag,coding")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-chat", action="store_true", help="raw prompts, without the chat template")
    parser.add_argument("--context", type=int, help="long prompts of this many tokens (--dataset haystack)")
    parser.add_argument("--one-document", action="store_true", help="the long prompts all about one document")
    parser.add_argument("--step-cost", type=float, help="a drafted step's price in plain steps, for the decisions "
                        "and the pricing alike (default: the plan's at each batch size and context)")
    args = parser.parse_args()
    if args.step_cost is not None and not args.step_cost > 0:
        parser.error(f"--step-cost must be a positive number of plain steps, got {args.step_cost}")
    plan = load_plan(args.plan)
    decoder = load_decoder(args.plan, device="cpu")
    prompts = served_prompts(args.dataset, decoder.tokenizer, args.prompts, not args.no_chat, args.context,
                             args.one_document)
    decoder.engine.clock = None  # the decisions on the plan's price alone, whatever the steps take here
    pricing = decoder.engine.pricing
    if args.step_cost is not None and pricing is not None:
        def at_step_cost(batch: int, context: int) -> tuple[float, float] | None:
            priced = pricing(batch, context)
            return None if priced is None else (priced[0], priced[0] / args.step_cost)
        decoder.engine.pricing = at_step_cost
    decided = priced_run(decoder, prompts, args.max_new_tokens, plan, args.step_cost)
    decoder.draft_every_step()
    always = priced_run(decoder, prompts, args.max_new_tokens, plan, args.step_cost)
    decoder.engine.pricing = pricing
    agreeing = sum(a == b for a, b in zip(decided["outputs"], always["outputs"]))
    predicted = plan.predicted_at(1, statistics.median(len(ids) for ids in prompts))
    print(f"{args.plan}: {args.dataset}{' (raw)' if args.no_chat else ''}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens, {decided['tokens']} tokens; the plan's price at B = 1: "
          f"{predicted[0]:.2f} tokens per drafted step for {predicted[1]:.3f}x"
          + (f"; priced here at {args.step_cost} plain steps a drafted step" if args.step_cost else ""))
    for name, run in (("decisions", decided), ("every step", always)):
        print(f"  {name:<11} priced speedup {run['speedup']:.3f}x, {run['drafted']:.0%} of steps drafted, "
              f"{run['per_drafted_step']:.2f} tokens per drafted step")
    print(f"  decisions / the better of drafting every step and never: "
          f"{decided['speedup'] / max(always['speedup'], 1.0):.3f}")
    if agreeing < len(prompts):  # exact in fp32; K-quant blocks round a forward's inputs (docs/design.md)
        print(f"  greedy outputs of the two runs identical for {agreeing} of {len(prompts)} prompts "
              f"({plan.models.dtype})")


if __name__ == "__main__":
    main()
