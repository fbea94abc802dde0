"""A step of B sequences where k of them draft n rows and the others one (the ragged steps a plan's shared rows make),
timed on the lean forward, against the price the plan's sharing table gives it (`RowSharing.seconds` at the same total
of rows: the uniform steps either side, and where the plan carries one sequence's forward timed at every total, that
forward's step from one total to the next) and against the straight line between the uniform steps alone: each as a
multiple of the plain step of B rows. The drafting sequences sit first in the batch or spread through it: the
attention kernel's threads once took contiguous shares of its tasks, and the first placement gave one thread the
trees.

    .venv/bin/python bench/ragged_rows.py plans/smollm2-135m.lookahead.cpu-2c-zen5.fp32.shared.yaml --batch 16
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from specplan.core.errors import UserError
from specplan.core.models import load_model
from specplan.core.plan_schema import load_plan
from specplan.decoder.api import load_forward
from specplan.decoder.model import ForwardItem, causal_mask
from specplan.profiler.latency import random_cache

# (sequences drafting, rows each): a few extra rows one per sequence, a few drafting long, most drafting, and every
# one at uniform rows, the table's own
SHAPES = ((0, 1), (1, 2), (2, 2), (4, 2), (5, 2), (8, 2), (1, 4), (2, 4), (4, 4), (8, 4), (1, 8), (2, 8), (16, 2),
          (16, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("plan")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--passes", type=int, default=15)
    args = parser.parse_args()
    try:
        plan = load_plan(args.plan)
    except UserError as error:
        parser.error(str(error))
    if plan.sharing is None:
        parser.error(f"{args.plan}: no sharing table (solve with --share-rows)")
    table, batch, context = plan.sharing, args.batch, plan.sharing.context
    model = load_forward(load_model(plan.models.target, plan.models.dtype), "cpu")
    caches = [random_cache(model, context, max(n for _, n in SHAPES)) for _ in range(batch)]
    shapes = [(k, n) for k, n in SHAPES if k <= batch]

    def step(drafting: int, rows: int, spread: bool) -> list[ForwardItem]:
        # the drafting sequences first in the batch, or spread through it every batch / drafting places
        chosen = set(list(range(0, batch, batch // drafting))[:drafting] if spread else range(drafting))
        items = []
        for i, cache in enumerate(caches):
            m = rows if i in chosen else 1
            mask = causal_mask(context, m, model.dtype, model.device) if m > 1 else None
            items.append(ForwardItem(torch.randint(0, model.shape.vocab, (m,)), torch.arange(context, context + m),
                                     cache, mask))
        return items

    # (drafting, rows, spread): the sequences drafting first in the batch, or spread through it
    cases = [(k, n, spread) for k, n in shapes for spread in ((False, True) if 1 < k < batch else (False,))]
    timed: dict[tuple[int, int, bool], list[float]] = {case: [] for case in cases}
    with torch.inference_mode():
        for _ in range(args.passes):
            for case in cases:  # interleaved, so that a slow spell touches every case alike
                items = step(*case)
                model.forward_many(items)
                start = time.perf_counter()
                model.forward_many(items)
                timed[case].append(time.perf_counter() - start)
    linear = dataclasses.replace(table, row_seconds=())
    plain, plain_price = statistics.median(timed[(0, 1, False)]), table.seconds(batch, batch)
    print(f"B = {batch}, {context} keys, {plan.models.target} {plan.models.dtype}; medians of {args.passes} passes; "
          f"the table {'with' if table.row_seconds else 'without'} every total timed")
    for k, n, spread in cases:
        rows = batch + k * (n - 1)
        measured, price = statistics.median(timed[(k, n, spread)]), table.seconds(batch, rows)
        where = "spread" if spread else "first " if 1 < k < batch else "      "
        print(f"{k:2d} x {n} {where} ({rows:3d} rows): measured {measured * 1e3:6.1f} ms, {measured / plain:.3f} of "
              f"plain; the table {price * 1e3:6.1f} ms, {price / plain_price:.3f}; the straight line "
              f"{linear.seconds(batch, rows) / plain_price:.3f}")


if __name__ == "__main__":
    main()
