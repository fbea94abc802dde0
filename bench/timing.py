"""The timer bench/'s micro-benchmarks share: every call timed once per round, the rounds interleaving the calls so
that a drifting machine (these VMs drift by tens of percent over minutes) slows each alike; warm-up rounds first; the
median per call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_medians(calls: dict[str, Callable[[], object]], repeats: int = 15, warmup: int = 2
                        ) -> dict[str, float]:
    """{name: median seconds of one call} over `repeats` rounds, after `warmup` untimed ones."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(warmup + repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def median_seconds(call: Callable[[], object], repeats: int = 15, warmup: int = 2) -> float:
    return interleaved_medians({"call": call}, repeats, warmup)["call"]
