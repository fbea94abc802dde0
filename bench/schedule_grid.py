"""A schedule against its fixed settings, from `plan bench --concurrency ... --settings ... [--rules ...]` runs: per
concurrency, every system's aggregate tokens/s (the mean over the runs and rounds given, and their spread), the best
fixed setting (ours-ar: off), the schedule's ratio to it and to off (ratio of the means, and the range of the ratios
within each round, where the two ran side by side; a plan's shared rows also against the plan without them,
ours-unshared; and against the best of the engines' drafting rules served beside it), and each system's measured /
predicted: the load's price the bench wrote beside it (planner/closed_loop.py; and the price at the measured tokens per
step; the records its drafting was replayed on printed first), or for results from before, the plan solver's decode-step
rate at B = the concurrency.

Where the run kept step logs (`plan bench --step-logs`), also the schedule against the best fixed setting in the seconds
of its servers' level steps outside prefills: the steps after the warm-up's requests (the first `concurrency` to
finish), a step after which requests joined counted at the median of the steps of its batch size and kind without one.
Every system serves the same requests to the same tokens, so that ratio compares the decoding alone, where a level's
wall also holds its prefills: over one long document (TriForce's haystack) a single prefill of 18-28 s is a third of a
level, and its spread from one server to the next is several percent of the level.

    .venv/bin/python bench/schedule_grid.py PLAN.yaml RUN1.jsonl [RUN2.jsonl ...]
"""

from __future__ import annotations

import bisect
import itertools
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from step_log import read_steps

from specplan.core.errors import UserError
from specplan.core.plan_schema import load_plan, setting_name
from specplan.serving import is_fixed_setting, load_levels, step_log_path


def predicted_rates(plan_path: str) -> dict[str, list[float | None]]:
    """System name -> the solver's predicted tokens/s at B = 1, 2, ... ("ours": the chosen envelope)."""
    plan = load_plan(plan_path)
    rates = plan.solver.get("schedule", {}).get("tokens_per_second", {})
    named: dict[str, list[float | None]] = {"ours-ar": rates.get("off", [])}
    for nodes in range(2, (plan.largest_setting or 1) + 1):  # `plan serve --setting N`: N nodes, root included
        if setting_name(plan.method, nodes) in rates:
            named[f"setting-{nodes}"] = rates[setting_name(plan.method, nodes)]
    if plan.schedule is not None:  # the schedule takes the best setting at each batch size
        named["ours"] = [max(values[batch] for values in rates.values() if values[batch] is not None)
                         for batch in range(len(named["ours-ar"]))]
    return named


def main(plan_path: str, runs: list[str]) -> None:
    measured: dict[tuple[str, int], list[float]] = defaultdict(list)
    side_by_side: dict[tuple[str, int], dict[tuple[int, int], float]] = defaultdict(dict)  # (run, round) -> tokens/s
    decoding: dict[tuple[str, int], dict[tuple[int, int], float]] = defaultdict(dict)  # (run, round) -> seconds
    priced: dict[tuple[str, int], list[tuple[float, float | None]]] = defaultdict(list)  # (measured/price, /repriced)
    bases: set[str] = set()
    for number, run in enumerate(runs):
        for level in load_levels(run):
            key = (level.system, level.concurrency)
            bases |= {level.price_basis} if level.price_basis else set()
            measured[key].append(level.tokens_per_second)
            side_by_side[key][(number, level.round)] = level.tokens_per_second
            log = step_log_path(Path(run), level.system, level.concurrency, level.round)
            if log.exists():
                decoding[key][(number, level.round)] = seconds_outside_prefills(log, level.concurrency)
            if level.predicted_tokens_per_second:
                priced[key].append((level.tokens_per_second / level.predicted_tokens_per_second,
                                    level.tokens_per_second / level.repriced_tokens_per_second
                                    if level.repriced_tokens_per_second else None))
    predicted = predicted_rates(plan_path)
    for basis in sorted(bases):
        print(f"drafting priced on {basis}")
    systems = sorted({system for system, _ in measured})
    for concurrency in sorted({c for _, c in measured}):
        means = {s: statistics.mean(measured[(s, concurrency)]) for s in systems if (s, concurrency) in measured}
        fixed = {s: rate for s, rate in means.items() if is_fixed_setting(s)}
        best = max(fixed, key=fixed.get)
        line = [f"C={concurrency:2d}"]
        for system, rate in means.items():
            values = measured[(system, concurrency)]
            spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
            ratio = _ratio(priced[(system, concurrency)], predicted.get(system), concurrency, rate)
            line.append(f"{system} {rate:.1f}{spread}{ratio}")
        print("; ".join(line))
        if "ours" in means and "ours-ar" in means:
            paired = side_by_side[("ours", concurrency)]
            off = side_by_side[("ours-ar", concurrency)]
            print(f"      schedule / best fixed ({best}) {means['ours'] / fixed[best]:.3f}"
                  f"{_round_range(paired, side_by_side[(best, concurrency)])}, schedule / off "
                  f"{means['ours'] / means['ours-ar']:.3f}{_round_range(paired, off)}")
        if "ours" in means and decoding[("ours", concurrency)] and decoding[(best, concurrency)]:
            ours, other = decoding[("ours", concurrency)], decoding[(best, concurrency)]
            print(f"      outside prefills: schedule / best fixed ({best}) "
                  f"{statistics.mean(other.values()) / statistics.mean(ours.values()):.3f}"
                  f"{_round_range({k: 1 / v for k, v in ours.items()}, {k: 1 / v for k, v in other.items()})}")
        rules = {s: rate for s, rate in means.items() if s.startswith("rule-")}  # `--rules`: the engines' rules
        if "ours" in means and rules:
            top = max(rules, key=rules.get)
            print(f"      schedule / best rule ({top}) {means['ours'] / rules[top]:.3f}"
                  f"{_round_range(side_by_side[('ours', concurrency)], side_by_side[(top, concurrency)])}")
        if "ours" in means and "ours-unshared" in means:  # a plan's shared rows against its static schedule
            unshared = side_by_side[("ours-unshared", concurrency)]
            print(f"      shared rows / unshared {means['ours'] / means['ours-unshared']:.3f}"
                  f"{_round_range(side_by_side[('ours', concurrency)], unshared)}")


def seconds_outside_prefills(path: Path, warmup_requests: int) -> float:
    """A server's step seconds after its warm-up's requests finished, each step after which requests joined (its
    seconds hold their prefills) counted at the median of its batch size and kind without one (its own seconds where
    there is none)."""
    steps = read_steps(path)
    finished = list(itertools.accumulate(step["finished"] for step in steps))
    steps = steps[bisect.bisect_left(finished, warmup_requests) + 1:]  # after the step the warm-up ended in
    plain_steps: dict[tuple[int, str | None], list[float]] = defaultdict(list)
    for step in steps:
        if not step["admitted_after"]:
            plain_steps[(step["batch"], step["kind"])].append(step["seconds"])
    return sum(statistics.median(plain_steps[(step["batch"], step["kind"])])
               if step["admitted_after"] and plain_steps[(step["batch"], step["kind"])] else step["seconds"]
               for step in steps)


def _round_range(ours: dict[tuple[int, int], float], other: dict[tuple[int, int], float]) -> str:
    """The range of ours / other over the rounds both ran in, where there are several."""
    ratios = [ours[key] / other[key] for key in ours.keys() & other.keys()]
    return f" (rounds {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)})" if len(ratios) > 1 else ""


def _ratio(priced: list[tuple[float, float | None]], decode_rates: list[float | None] | None, concurrency: int,
           rate: float) -> str:
    """Measured / the load's price (and / its price at the measured tokens per step), from the results where the
    bench priced the load; else measured / the solver's decode-step rate at B = C (results from before)."""
    if priced:
        repriced = [r for _, r in priced if r is not None]
        again = f", x{statistics.mean(repriced):.2f} repriced" if repriced else ""
        return f" x{statistics.mean(p for p, _ in priced):.2f} of its price{again}"
    if decode_rates and len(decode_rates) >= concurrency and decode_rates[concurrency - 1]:
        return f" x{rate / decode_rates[concurrency - 1]:.2f} of the decode step's rate"
    return ""


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2:])
    except UserError as error:  # a missing or malformed run: one line, as the CLI says it
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
