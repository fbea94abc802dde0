"""Progress notes on stderr: what a long command is doing, whether stderr is a terminal or a log file. The library's
own long waits (building the CPU kernels, converting a GGUF file, downloading a preset) announce themselves here
too. `plan ... --quiet` silences them; an error stays the one line the CLI prints."""

from __future__ import annotations

import sys
import time

_quiet = False


def set_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet


def say(message: str) -> None:
    if not _quiet:
        print(message, file=sys.stderr, flush=True)


class Steps:
    """A count of done steps out of `total`: a bar on a terminal, a line per step elsewhere (a log under nohup)."""

    def __init__(self, total: int, label: str, unit: str) -> None:
        self.total, self.label, self.unit = total, label, unit
        self.done = 0
        self.started = time.perf_counter()
        self.bar = None
        if not _quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit=unit, leave=False, file=sys.stderr)

    def update(self, count: int = 1) -> None:
        self.done += count
        if self.bar is not None:
            self.bar.update(count)
        else:
            say(f"{self.label}: {self.done}/{self.total} {self.unit} ({time.perf_counter() - self.started:.0f} s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
