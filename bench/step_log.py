"""A served run's steps, by batch size and kind, from the step logs `plan bench --step-logs` has our servers write
(`plan serve --step-log`): how many of each, the median seconds of those the engine's clock timed, and of the steps
that follow a request's end (its response going out, the client's next request coming in) apart from the rest; the
clock's measured price of a drafted step in plain steps as it went, and the prices the requests decided at.

    .venv/bin/python bench/step_log.py docs/reports/serving/RESULTS.ours.c8.r1.steps.log [MORE.steps.log ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

# Steps after a request's end that count as its wake (the client's round trip and the next request's arrival)
WAKE_STEPS = 2


def median_ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.1f}" if values else "-"


def summarize(path: str) -> None:
    with open(path) as handle:
        steps = [json.loads(line) for line in handle if line.strip()]
    since_end = WAKE_STEPS + 1
    rows: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for step in steps:
        kind = step["kind"] or "mixed"
        row = rows[step["batch"]]
        row[kind].append(step)
        if step["timed"]:
            row[f"timed {kind}"].append(step["seconds"])
            row[f"timed {kind} {'wake' if since_end <= WAKE_STEPS else 'quiet'}"].append(step["seconds"])
        if step["clock_price"] is not None:
            row["clock"].append(step["clock_price"])
        if step["price"] is not None:
            row["price"].append((step["price"], step["expected"]))
        since_end = 1 if step["finished"] else since_end + 1
    print(f"{path}: {len(steps)} steps")
    print("| B | drafted / plain / mixed steps | timed drafted ms (quiet, wake) | timed plain ms (quiet, wake) | "
          "measured ratio | the clock's price (first, min, max, last) | decided at: price / expected (median) |")
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
                         f"({median_ms(row[f'timed {kind} quiet'])}, {median_ms(row[f'timed {kind} wake'])} x "
                         f"{len(row[f'timed {kind} wake'])})")
        print(f"| {batch} | " + " | ".join(cells + [ratio, clock_text, priced_text]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logs", nargs="+")
    for path in parser.parse_args().logs:
        summarize(path)


if __name__ == "__main__":
    main()
