"""A served run's steps, by batch size and kind, from the step logs `plan bench --step-logs` has our servers write
(`plan serve --step-log`): how many of each, the median seconds of the steps that follow a join (the clock's
UNTIMED_AFTER_JOIN) apart from the rest, of those the clock timed, the clock's measured price of a drafted step in plain
steps as it went, and the prices the requests decided at.

    .venv/bin/python bench/step_log.py docs/reports/serving/RESULTS.ours.c8.r1.steps.log [MORE.steps.log ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import defaultdict

from specplan.decoder.gate import UNTIMED_AFTER_JOIN


def median_ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.1f}" if values else "-"


def read_steps(path: str | os.PathLike) -> list[dict]:
    """A step log's records, in the order the steps ran."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def summarize(path: str) -> None:
    steps = read_steps(path)
    since_join = UNTIMED_AFTER_JOIN  # steps since the last one after which requests joined
    rows: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for step in steps:
        kind = step["kind"] or "mixed"
        row = rows[step["batch"]]
        row[kind].append(step)
        if not step["admitted_after"]:  # a step whose seconds hold no prefill
            row[f"{kind} {'after a join' if since_join < UNTIMED_AFTER_JOIN else 'rest'}"].append(step["seconds"])
        if step["timed"]:
            row[f"timed {kind}"].append(step["seconds"])
        if step["clock_price"] is not None:
            row["clock"].append(step["clock_price"])
        if step["price"] is not None:
            row["price"].append((step["price"], step["expected"]))
        since_join = 0 if step["admitted_after"] else since_join + 1
    print(f"{path}: {len(steps)} steps")
    print("| B | drafted / plain / mixed steps | drafted ms: timed (rest, after a join) | plain ms: timed (rest, "
          "after a join) | measured ratio | the clock's price (first, min, max, last) | decided at: price / expected |")
    print("|---|---|---|---|---|---|---|")
    for batch in sorted(rows):
        row = rows[batch]
        drafted, plain = row["timed drafted"], row["timed plain"]
        ratio = (f"{statistics.median(drafted) / statistics.median(plain):.2f}" if drafted and plain else "-")
        clock = row["clock"]
        clock_text = (f"{clock[0]:.2f}, {min(clock):.2f}, {max(clock):.2f}, {clock[-1]:.2f}" if clock else "-")
        priced = row["price"]
        priced_text = (f"{statistics.median(p for p, _ in priced):.2f} / {statistics.median(e for _, e in priced):.2f}"
                       if priced else "-")
        cells = [f"{len(row['drafted'])} / {len(row['plain'])} / {len(row['mixed'])}"]
        for kind in ("drafted", "plain"):
            cells.append(f"{median_ms(row[f'timed {kind}'])} x {len(row[f'timed {kind}'])} "
                         f"({median_ms(row[f'{kind} rest'])}, {median_ms(row[f'{kind} after a join'])} x "
                         f"{len(row[f'{kind} after a join'])})")
        print(f"| {batch} | " + " | ".join(cells + [ratio, clock_text, priced_text]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logs", nargs="+")
    for path in parser.parse_args().logs:
        summarize(path)


if __name__ == "__main__":
    main()
