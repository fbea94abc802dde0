"""A plan against one-token decoding of the same model (or its fixed settings), each at C requests in flight in this
process (`generate_many`, no HTTP server), in rounds of rotating order: where two servers of `plan bench
--concurrency` differ by tens of percent running the same steps (the order the clients' requests arrive in decides
whether a batch runs in lockstep), this says what the plan's own steps cost. Each run is warmed up first
(warmup_tokens, as the serving bench does, on fresh drafters and clock), then every scheduler step is timed with its
batch size, whether any sequence drafted, and the roots its draft models had still to read. `--as-served` sends
the requests as the serving bench's clients do (its order per round, each client's next request a step after its
last completed) where a served gap is in question.

    .venv/bin/python bench/load_in_process.py plans/qwen2.5-coder-1.5b.sequoia-v64k.cpu-2c.gguf.yaml --concurrency 8 \
        --dataset specbench:qa,math_reasoning,translation,extraction --no-chat --prompts 16 --rounds 2
    .venv/bin/python bench/load_in_process.py plans/smollm2-135m.lookahead.cpu-2c.fp32.batched.yaml --concurrency 1 \
        --dataset specbench:summarization,rag,coding --against setting-2 --rounds 4
    .venv/bin/python bench/load_in_process.py plans/smollm2-135m.lookahead.cpu-2c-avx2.gguf.shared.yaml \
        --concurrency 4 --no-chat --prompts 16 --against unshared --rounds 4
    .venv/bin/python bench/load_in_process.py plans/smollm2-135m.triforce-7680.cpu-2c-zen3.fp32.batched.yaml \
        --concurrency 4 --dataset haystack --context 7680 --one-document --prompts 8 --max-new-tokens 128 \
        --against one-token,setting-4 --rounds 2
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict, deque

from specplan.decoder.api import Decoder, load_decoder
from specplan.decoder.batching import Completion, Request, Scheduler
from specplan.decoder.gate import StepClock
from specplan.profiler.haystack import served_prompts
from specplan.serving import prompts_at_level, warmup_prompts, warmup_tokens


class StepLog:
    """Every scheduler step: its seconds, the sequences it ran (those joining in it not counted), how many drafted,
    the roots their draft models had yet to read (a Sequoia drafter's `pending`), and the requests that joined (their
    prefills in the step)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.step = Scheduler.step

    def __enter__(self) -> StepLog:
        log, step = self, self.step

        def timed(scheduler: Scheduler):
            running, waiting = list(scheduler.running), len(scheduler.waiting)
            unread = sum(len(getattr(entry.run.drafter, "pending", ())) for entry in running)
            began = time.perf_counter()
            done = step(scheduler)
            drafted = sum(1 for entry in running if entry.run.tree is not None and entry.run.tree.size > 1)
            log.steps.append({"seconds": time.perf_counter() - began, "batch": len(running), "drafted": drafted,
                              "unread": unread, "joined": waiting - len(scheduler.waiting)})
            return done

        Scheduler.step = timed
        return self

    def __exit__(self, *exc: object) -> None:
        Scheduler.step = self.step


def closed_loop(scheduler: Scheduler, requests: list[Request], concurrency: int) -> list[Completion]:
    """`concurrency` clients, each sending its next request the step after its last one completed (a served client's
    round trip: the response streams out as the next step starts), in `requests`' order."""
    queue, done, arriving = deque(requests), [], concurrency
    while queue or not scheduler.idle:
        for _ in range(min(arriving, len(queue))):
            scheduler.submit(queue.popleft())
        finished = scheduler.step()
        done += finished
        arriving = len(finished)
    return done


def run(decoder: Decoder, prompts: list[list[int]], concurrency: int, max_new_tokens: int, as_served: bool,
        warmup: int) -> dict:
    decoder.engine.clock = StepClock()
    decoder.restart()
    list(decoder.generate_many([Request(ids, warmup, ignore_eos=True)
                                for ids in warmup_prompts(prompts, concurrency)], concurrency))
    requests = [Request(ids, max_new_tokens) for ids in prompts]
    with StepLog() as log:
        began = time.perf_counter()
        done = (closed_loop(decoder.scheduler(concurrency), requests, concurrency) if as_served
                else list(decoder.generate_many(requests, concurrency)))
        wall = time.perf_counter() - began
    tokens = sum(len(c.result.tokens) for c in done)
    steps = sum(c.result.steps for c in done)
    drafted = sum(c.result.drafted_steps for c in done)
    # the steps no request joined in: decoding alone, apart from the prefills (a long prompt's dominate a load's wall)
    decoding = sum(step["seconds"] for step in log.steps if not step["joined"])
    return {"tokens_per_second": tokens / wall, "wall": wall, "decoding_seconds": decoding,
            "drafted_share": drafted / steps, "steps": log.steps}


def describe(name: str, result: dict) -> str:
    by_kind: dict[str, list[float]] = defaultdict(list)
    for step in result["steps"]:
        kind = ("with prefills" if step["joined"] else
                f"B = {step['batch']} " + ("drafted" if step["drafted"] else "plain"))
        by_kind[kind].append(step["seconds"])
    kinds = ", ".join(f"{kind} {len(s)} x {1e3 * statistics.median(s):.1f} ms" for kind, s in sorted(by_kind.items()))
    heavy = [f"{s['batch']}/{s['drafted']}/{s['unread']}: {s['seconds']:.2f} s" for s in result["steps"]
             if s["drafted"] and s["unread"] > 2 * s["batch"]]
    return (f"  {name:<10} {result['tokens_per_second']:6.2f} tokens/s ({result['wall']:.1f} s, "
            f"{result['decoding_seconds']:.1f} s in steps no request joined), "
            f"{result['drafted_share']:.0%} of steps drafted; steps: {kinds}"
            + (f"; drafted steps reading sat-out roots (batch/drafting/roots): {', '.join(heavy)}" if heavy else ""))


def against_decoder(plan_path: str, plan: Decoder, name: str, parser: argparse.ArgumentParser) -> Decoder:
    """The system `name` (one of --against's, checked) that the plan at `plan_path` runs against, on the plan
    decoder's own models: two copies of the same weights in one process ran their forwards 10-15% apart, the copy
    loaded first the slower (a VM's memory; docs/benchmark-log.md: "Two copies of one model"), which a comparison
    read as the systems' difference."""
    if name == "one-token":
        return Decoder(plan.target, lambda: None, None, None, plan.target_forward)
    if name == "unshared" and plan.plan.sharing is None:
        parser.error(f"{plan_path} shares no rows (solved without --share-rows): nothing to compare unshared")
    sibling = Decoder(plan.target, plan.make_drafter, plan.plan, None, plan.target_forward, plan.draft,
                      plan.draft_forward)
    if name.startswith("setting-"):
        sibling.fix_setting(int(name.removeprefix("setting-")))
    else:
        sibling.unshared()
    return sibling


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--dataset", default="specbench:qa,math_reasoning,translation,extraction")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-chat", action="store_true", help="raw prompts, without the chat template")
    parser.add_argument("--context", type=int, help="long prompts of this many tokens built from --dataset's texts "
                        "(as `plan bench --context` builds them)")
    parser.add_argument("--one-document", action="store_true", help="the long prompts all about one document")
    parser.add_argument("--rounds", type=int, default=2, help="every system once a round, the order rotating")
    parser.add_argument("--as-served", action="store_true", help="arrivals as `plan bench --concurrency` sends them: "
                        "each round's prompts in its order (a fresh order each round after the first), each client's "
                        "next request a step after its last one completed; without it, every request queued at once, "
                        "in --dataset's order each round")
    parser.add_argument("--against", default="one-token", metavar="one-token|setting-N|unshared[,...]",
                        help="what the plan runs against, one or several (comma-separated): one-token decoding, one "
                        "of its settings at every step (`plan serve --setting N`: drafting N nodes, no schedule, no "
                        "decisions), or a plan with shared rows without them (`plan serve --no-sharing`)")
    args = parser.parse_args()
    others = list(dict.fromkeys(args.against.split(",")))
    for name in others:
        if not re.fullmatch(r"one-token|unshared|setting-\d+", name):
            parser.error(f"--against {name}: one-token, setting-N or unshared")
    plan = load_decoder(args.plan, device="cpu")
    systems = [("plan", plan)] + [(name, against_decoder(args.plan, plan, name, parser)) for name in others]
    prompts = served_prompts(args.dataset, plan.tokenizer, args.prompts, not args.no_chat, args.context,
                             args.one_document)
    print(f"{args.plan}: {args.dataset}{' (raw)' if args.no_chat else ''}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens at {args.concurrency} in flight")
    ratios: dict[str, list[float]] = defaultdict(list)
    decoding: dict[str, list[float]] = defaultdict(list)  # the same, in the steps no request joined
    for round_ in range(args.rounds):
        shift = round_ % len(systems)
        order = systems[shift:] + systems[:shift]
        sent = (prompts_at_level(prompts, args.concurrency, max(1, len(prompts) // args.concurrency), round_)
                if args.as_served else prompts)
        results = {name: run(decoder, sent, args.concurrency, args.max_new_tokens, args.as_served,
                             warmup_tokens(plan.plan))
                   for name, decoder in order}
        for name in others:
            ratios[name].append(results["plan"]["tokens_per_second"] / results[name]["tokens_per_second"])
            decoding[name].append(results[name]["decoding_seconds"] / results["plan"]["decoding_seconds"])
        print(f"round {round_ + 1} ({' then '.join(name for name, _ in order)}): "
              + ", ".join(f"plan / {name} {ratios[name][-1]:.3f} (steps no request joined: {decoding[name][-1]:.3f})"
                          for name in others))
        for name, _ in order:
            print(describe(name, results[name]))
    for name in others:
        print(f"plan / {name} over {args.rounds} rounds: {', '.join(f'{r:.3f}' for r in ratios[name])}; "
              f"mean {statistics.mean(ratios[name]):.3f}; in the steps no request joined, "
              f"{', '.join(f'{r:.3f}' for r in decoding[name])}, mean {statistics.mean(decoding[name]):.3f}")


if __name__ == "__main__":
    main()
