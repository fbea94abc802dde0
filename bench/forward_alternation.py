"""Does a TriForce step's forward cost what the profile says when the levels alternate?

`plan profile` times each forward right after an untimed one of the same shape over the same cache. A
TriForce step runs the middle level's forwards (gamma1 + 1 rows over the retrieval cache of `budget` slots;
one row for the two-level variant, `bottom: none`) several times, then the top level's (gamma2 + 1 rows over the full
cache). This times both shapes repeated, as the profile does, and in that alternation, as decoding runs
them, beside one-token forwards over the full cache, with the profile's price of each; medians over the
rounds. Cache contents are random, as in the profile: the cost does not depend on them.

With --trace SECONDS it then runs the step's pattern (and a one-token forward) for that long and prints each
shape's median time per 5 seconds: a host whose speed changes over time shows here, apart from any effect of
the alternation.

    python bench/forward_alternation.py --plan plans/smollm2-135m.triforce-7680.cpu-2c.bf16.yaml \
        --profile profiles/smollm2-135m.cpu-2c.bf16-7680.yaml --rounds 12 --trace 120
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from specplan.core.errors import UserError
from specplan.core.profile_schema import load_profile
from specplan.decoder.api import load_decoder
from specplan.decoder.model import KVCache, LeanModel, causal_mask
from specplan.profiler.latency import random_cache

Pattern = list[tuple[str | None, KVCache, int]]  # (label of a timed forward or None, cache, rows)


@torch.inference_mode()
def forward_seconds(model: LeanModel, cache: KVCache, rows: int) -> float:
    tokens = torch.randint(0, model.shape.vocab, (rows,))
    positions = torch.arange(cache.length, cache.length + rows)
    mask = causal_mask(cache.length, rows, model.dtype, model.device) if rows > 1 else None
    start = time.perf_counter()
    model.forward(tokens, positions, cache, mask)
    return time.perf_counter() - start


def one_pass(model: LeanModel, pattern: Pattern) -> dict[str, list[float]]:
    """Seconds of each labelled forward in one pass of the pattern."""
    taken: dict[str, list[float]] = {}
    for label, cache, rows in pattern:
        seconds = forward_seconds(model, cache, rows)
        if label:
            taken.setdefault(label, []).append(seconds)
    return taken


def run_pattern(model: LeanModel, pattern: Pattern, rounds: int) -> dict[str, float]:
    """Median seconds per labelled forward over `rounds` passes of the pattern, after one untimed pass."""
    one_pass(model, pattern)
    timed: dict[str, list[float]] = {}
    for _ in range(rounds):
        for label, seconds in one_pass(model, pattern).items():
            timed.setdefault(label, []).extend(seconds)
    return {label: statistics.median(values) for label, values in timed.items()}


def trace(model: LeanModel, pattern: Pattern, seconds: float, prices: dict[str, float], window: float = 5.0) -> None:
    """Runs `pattern` round after round for `seconds`; prints, for each `window` seconds, each labelled forward's
    median time against its profiled price, then each one's range of window medians over the run."""
    labels = list(dict.fromkeys(label for label, _, _ in pattern if label))
    print("| second | rounds | " + " | ".join(f"{label} ms (/ profile)" for label in labels) + " |")
    print("|---" * (len(labels) + 2) + "|")
    medians: dict[str, list[float]] = {label: [] for label in labels}
    start = time.perf_counter()
    window_start = 0.0
    while window_start < seconds:
        taken: dict[str, list[float]] = {label: [] for label in labels}
        rounds = 0
        while not rounds or time.perf_counter() - start < window_start + window:  # a round at least
            for label, seconds_taken in one_pass(model, pattern).items():
                taken[label].extend(seconds_taken)
            rounds += 1
        cells = []
        for label in labels:
            medians[label].append(statistics.median(taken[label]) / prices[label])
            cells.append(f"{statistics.median(taken[label]) * 1e3:.1f} ({medians[label][-1]:.2f})")
        print(f"| {window_start:.0f} | {rounds} | " + " | ".join(cells) + " |", flush=True)
        window_start += window
    for label, values in medians.items():
        print(f"{label}: {window:.0f}-second medians at {min(values):.2f}-{max(values):.2f}x the profile's price")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--trace", type=float, default=0.0, metavar="SECONDS",
                        help="then follow the shapes for this long, 5-second medians against the profile")
    args = parser.parse_args()
    try:
        decoder = load_decoder(args.plan)
        profile = load_profile(args.profile)
    except UserError as error:
        parser.error(str(error))
    plan = decoder.plan
    if plan is None or plan.method != "triforce" or not plan.settings.speculate \
            or plan.settings.bottom == "streaming":
        parser.error(f"{args.plan}: not a TriForce plan that drafts through a retrieval cache")
    settings, model = plan.settings, decoder.target_forward
    gamma2 = settings.gamma2
    gamma1 = 0 if settings.bottom == "none" else settings.gamma1  # two-level: the middle drafts alone
    middle_rows = gamma1 + 1
    middles_per_top = math.ceil(gamma2 / gamma1) if gamma1 else gamma2
    top_rows = gamma2 + 1
    full = random_cache(model, settings.context, top_rows)
    middle = random_cache(model, settings.budget, middle_rows)
    shapes = {"one token": (full, 1), f"top, {top_rows} rows": (full, top_rows),
              f"middle, {middle_rows} rows": (middle, middle_rows)}
    repeated = {}
    for label, (cache, rows) in shapes.items():
        repeated.update(run_pattern(model, [(None, cache, rows), (label, cache, rows)], args.rounds))
    top_label, middle_label = list(shapes)[1:]
    step: Pattern = [(middle_label, middle, middle_rows)] * middles_per_top + [(top_label, full, top_rows)]
    alternating = run_pattern(model, step, args.rounds)
    alternating.update(run_pattern(model, [(None, full, top_rows), ("one token", full, 1)], args.rounds))
    print(f"{args.plan}: gamma1 {gamma1}, gamma2 {gamma2}, budget {settings.budget}, context "
          f"{settings.context}; a step = {middles_per_top} middle forwards, then the top's; {args.rounds} rounds")
    prices = {label: profile.latency(rows, cache.length) for label, (cache, rows) in shapes.items()}
    print("| forward | profile ms | repeated ms | in the step ms | in the step / repeated |")
    print("|---|---|---|---|---|")
    for label, (cache, _) in shapes.items():
        ratio = alternating[label] / repeated[label]
        print(f"| {label} over {cache.length} | {prices[label] * 1e3:.1f} | {repeated[label] * 1e3:.1f} | "
              f"{alternating[label] * 1e3:.1f} | {ratio:.3f} |")
    print("(one token 'in the step': right after a top-level forward)")
    if args.trace > 0:
        trace(model, [("one token", full, 1)] + step, args.trace, prices)


if __name__ == "__main__":
    main()
