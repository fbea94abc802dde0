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

`--concurrency C` (C > 1) replays a served level instead: the prompts queued at once on C slots of the continuous-
batching scheduler, after the serving bench's warm-up, with the engine's clock on (decoder/gate.py: StepClock) and every
decision a served plan makes at C in flight (the step's mix, the clock's timing steps and borrowed prices,
joiners' priors). The clock reads priced time, not the machine's: each step advances it by t(B, 1) of the plan's profile
at the step's B sequences, a step in which all drafted by that times the drafted step's price at B (the plan's, or
`--step-cost`), one in which k of them did by the plan's share for that mix of what a drafted step adds (its schedule's
`mix_shares`; all of it without them), as the gate prices it (decoder/gate.py: settle_step). One-token decoding's steps
follow from the output lengths alone (every sequence emits one token a step; a slot freed takes the next request at the
next step), priced the same way.

    .venv/bin/python bench/gate_replay.py plans/smollm2-135m.lookahead.cpu-2c.fp32.batched.yaml \
        --dataset specbench:summarization,rag,coding --prompts 16 --max-new-tokens 64 [--no-chat]
    .venv/bin/python bench/gate_replay.py plans/smollm2-135m.triforce-7680.cpu-2c-amx.fp32.batched.yaml \
        --dataset specbench:summarization,rag --context 7680 --one-document --max-new-tokens 128 --step-cost 5.6
    .venv/bin/python bench/gate_replay.py plans/smollm2-135m.triforce-7680.cpu-2c-amx.fp32.batched.yaml \
        --dataset specbench:summarization,rag --context 7680 --one-document --max-new-tokens 128 --concurrency 8 \
        --step-cost 6.5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

from specplan.core.plan_schema import Plan, load_plan
from specplan.core.profile_schema import load_profile
from specplan.decoder import batching, drafters, engine
from specplan.decoder.api import Decoder, load_decoder
from specplan.decoder.batching import Request
from specplan.decoder.engine import SequenceRun
from specplan.decoder.gate import StepClock
from specplan.profiler.haystack import served_prompts
from specplan.serving import warmup_prompts, warmup_tokens


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


class PricedTime:
    """The `time` the scheduler, the engine and the drafters read during a batched replay: the priced seconds of the
    steps so far."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def perf_counter(self) -> float:
        return self.seconds


@contextlib.contextmanager
def on_priced_time(priced: PricedTime) -> Iterator[None]:
    modules = (batching, engine, drafters)  # each reads time.perf_counter() alone
    machine = [module.time for module in modules]
    for module in modules:
        module.time = priced
    try:
        yield
    finally:
        for module, kept in zip(modules, machine):
            module.time = kept


class BatchedReplay:
    """A served level replayed on priced time (see the module's doc): `run` the decoder's plan, then `one_token`."""

    def __init__(self, concurrency: int, plain_seconds: Callable[[int], float],
                 drafted_price: Callable[[int], float], mix_share: Callable[[int, int], float | None]) -> None:
        self.concurrency = concurrency
        self.plain_seconds = plain_seconds  # t(B, 1)
        self.drafted_price = drafted_price  # a drafted step's price in plain steps at B
        self.mix_share = mix_share  # what k of B drafting add, as a share of what all B add (None: as all B)

    def run(self, decoder: Decoder, prompts: list[list[int]], max_new_tokens: int, warmup: int) -> dict:
        """The warm-up requests, then the prompts, through one scheduler (a served server's); the measured
        requests' tokens, priced seconds, outputs and per batch size their drafted steps."""
        decoder.engine.clock = StepClock()
        decoder.restart()
        scheduler = decoder.scheduler(self.concurrency)
        in_step: list[SequenceRun] = []
        decide = decoder.engine.decide

        def decide_seen(runs: list[SequenceRun], load: int | None = None) -> None:
            in_step[:] = runs
            decide(runs, load)

        decoder.engine.decide = decide_seen
        priced = PricedTime()
        # B -> (each sequence's tokens, the decisions' reasons) of each step any sequence drafted in
        drafted_steps: dict[int, list[tuple[list[int], Counter]]] = defaultdict(list)
        plain_steps: Counter[int] = Counter()
        try:
            with on_priced_time(priced):
                for ids in warmup_prompts(prompts, self.concurrency):
                    scheduler.submit(Request(ids, warmup, ignore_eos=True))
                while not scheduler.idle:
                    in_step.clear()
                    scheduler.step()
                    priced.seconds += self._price(in_step)
                began, done = priced.seconds, []
                for ids in prompts:
                    scheduler.submit(Request(ids, max_new_tokens))
                while not scheduler.idle:
                    in_step.clear()
                    done += scheduler.step()
                    priced.seconds += self._price(in_step)
                    if any(run.drafted_per_step[-1] for run in in_step):
                        drafted_steps[len(in_step)].append((
                            [run.accepted_per_step[-1] for run in in_step],
                            Counter(f"{run.gate.reason}: {'drafts' if run.drafted_per_step[-1] else 'plain'}"
                                    for run in in_step if run.gate is not None)))
                    elif in_step:
                        plain_steps[len(in_step)] += 1
        finally:
            del decoder.engine.decide
        outputs = [c.result.tokens for c in sorted(done, key=lambda c: c.id)]
        return {"tokens": sum(map(len, outputs)), "seconds": priced.seconds - began, "outputs": outputs,
                "drafted_steps": drafted_steps, "plain_steps": plain_steps}

    def _price(self, runs: list[SequenceRun]) -> float:
        """A step's priced seconds: t(B, 1), plus where k of its B sequences drafted the plan's share for that mix of
        what a drafted step adds (all of it where the plan priced no mix), as the gate prices such a step
        (DraftGate.mix_cost)."""
        if not runs:
            return 0.0
        batch = len(runs)
        drafting = sum(1 for run in runs if run.drafted_per_step[-1])
        share = self.mix_share(batch, drafting) if drafting else 0.0
        return self.plain_seconds(batch) * (1.0 + (self.drafted_price(batch) - 1.0) * (1.0 if share is None else share))

    def one_token(self, lengths: list[int]) -> float:
        """One-token decoding's priced seconds for requests of these output lengths, queued at once."""
        queue, running, seconds = list(reversed(lengths)), [], 0.0
        while queue or running:
            while queue and len(running) < self.concurrency:
                running.append(queue.pop())
            seconds += self.plain_seconds(len(running))
            running = [left - 1 for left in running if left > 1]
        return seconds


def batched_replay(args: argparse.Namespace, plan: Plan, decoder: Decoder, prompts: list[list[int]]) -> None:
    profile = load_profile(plan.inputs["profile"]["file"])
    context = statistics.median(len(ids) for ids in prompts) + args.max_new_tokens / 2

    def drafted_price(batch: int) -> float:
        if args.step_cost is not None:
            return args.step_cost
        predicted = plan.predicted_at(batch, int(context))
        if predicted is None:
            raise SystemExit(f"the plan prices no drafted step at B = {batch}: give --step-cost")
        return predicted[0] / predicted[1]

    def mix_share(batch: int, drafting: int) -> float | None:
        return plan.schedule.mix_share(batch, drafting, int(context)) if plan.schedule is not None else None

    replay = BatchedReplay(args.concurrency, lambda batch: profile.batch_latency(batch, 1, context), drafted_price,
                           mix_share)
    warmup = warmup_tokens(plan)
    decided = replay.run(decoder, prompts, args.max_new_tokens, warmup)
    decoder.draft_every_step()
    always = replay.run(decoder, prompts, args.max_new_tokens, warmup)
    one_token = replay.one_token([len(tokens) for tokens in decided["outputs"]])
    print(f"{args.plan}: {args.dataset}{' (raw)' if args.no_chat else ''}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens at {args.concurrency} in flight, {decided['tokens']} tokens; a drafted step "
          + (f"priced at {args.step_cost} plain steps" if args.step_cost else "at the plan's price")
          + f"; t(B, 1) of {plan.inputs['profile']['file']} at {context:.0f} tokens")
    for name, run in (("decisions", decided), ("every step", always)):
        drafted = sum(len(steps) for steps in run["drafted_steps"].values())
        print(f"  {name:<11} priced speedup {one_token / run['seconds']:.3f}x over one-token decoding, "
              f"{drafted} drafted steps, {sum(run['plain_steps'].values())} plain")
        for batch in sorted(run["drafted_steps"]):
            steps = run["drafted_steps"][batch]
            why = sum((reasons for _, reasons in steps), Counter())
            print(f"    B = {batch}: {len(steps)} drafted steps ({run['plain_steps'][batch]} plain) at "
                  f"{drafted_price(batch):.2f} plain steps, "
                  f"{statistics.fmean(statistics.fmean(t) for t, _ in steps):.2f} tokens a sequence; "
                  + ", ".join(f"{reason} {count}" for reason, count in why.most_common()))
            if args.steps and name == "decisions":
                for tokens, reasons in steps:
                    print(f"      {' '.join(map(str, tokens))}: " + ", ".join(f"{r} {c}" for r, c in reasons.items()))
    agreeing = sum(a == b for a, b in zip(decided["outputs"], always["outputs"]))
    if agreeing < len(prompts):
        print(f"  greedy outputs of the two runs identical for {agreeing} of {len(prompts)} prompts "
              f"({plan.models.dtype})")


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
    parser.add_argument("--steps", action="store_true", help="with --concurrency: each drafted step of the decisions, "
                        "its sequences' tokens and why they drafted or not")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight: above 1, a served level "
                        "replayed on the scheduler with the engine's clock on priced time")
    args = parser.parse_args()
    if args.step_cost is not None and not args.step_cost > 0:
        parser.error(f"--step-cost must be a positive number of plain steps, got {args.step_cost}")
    if args.concurrency < 1:
        parser.error(f"--concurrency must be at least 1, got {args.concurrency}")
    plan = load_plan(args.plan)
    decoder = load_decoder(args.plan, device="cpu")
    prompts = served_prompts(args.dataset, decoder.tokenizer, args.prompts, not args.no_chat, args.context,
                             args.one_document)
    pricing = decoder.engine.pricing
    if args.step_cost is not None and pricing is not None:
        def at_step_cost(batch: int, context: int) -> tuple[float, float] | None:
            priced = pricing(batch, context)
            return None if priced is None else (priced[0], priced[0] / args.step_cost)
        decoder.engine.pricing = at_step_cost
    if args.concurrency > 1:
        batched_replay(args, plan, decoder, prompts)
        return
    decoder.engine.clock = None  # the decisions on the plan's price alone, whatever the steps take here
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
