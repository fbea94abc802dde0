"""The price of a serving load: what a closed loop of C clients gets in aggregate output tokens/s from a plan.

A schedule's entries price a decode step with B sequences always in flight. A served load is not that: each request
is prefilled as it joins (the target's prefill of its prompt, less the prefix its slot's cache still holds from the
slot's last request), the batch fills and drains as requests start and finish, and `plan bench --concurrency` counts
every output token over the whole wall time. This module replays that load step by step as the decoder's scheduler
runs it (decoder/batching.py): C clients each send their next prompt when their last one completes; waiting requests
join free slots (the one holding the longest prefix of the prompt, else the lowest) between steps and are prefilled
there beyond that prefix, or one the prompt cache kept, or one a sequence in flight holds (copied), before the next
step; each step, every sequence in flight gains its setting's tokens per step, the setting chosen for the batch size in
flight; the step costs t(B, n) at the sequences' contexts, the engine's overhead o(n, B), each drafter's host work and
the draft model's levels. Tokens per step are the replays' means (every sequence advances alike: the waves of a closed
loop drain only as their requests' output lengths differ); the prefills are the profile's `target.prefill_seconds`,
measured with `plan profile --batches`.
"""

from __future__ import annotations

import functools
import os
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from specplan.core.choices import CANDIDATE_SPEEDUP, MIN_SAVED_TOKENS, MIN_SPEEDUP
from specplan.core.errors import UserError
from specplan.core.plan_schema import BatchSchedule, Candidate, mix_points, setting_name
from specplan.core.profile_schema import LatencyProfile

# A completed request's client sends its next one this long after the server's last token (the HTTP round trip on
# the loopback and the server's admission); the slot waits for it unless others keep the steps going.
CLIENT_TURNAROUND_SECONDS = 0.002

# The random batches of replayed steps a batch size's ragged step is priced over (its mean within about 1%).
BATCH_DRAWS = 512


@dataclass(frozen=True)
class SettingPrice:
    """One drafting setting, per sequence and step: what it emits, and what it costs beyond the target's rows."""

    tokens_per_step: float  # emitted per sequence per step (1: no drafting)
    rows: float = 1.0  # the target's new rows per sequence per step: the draft's nodes, root included
    host_seconds: float = 0.0  # the drafter's work per sequence per step alone (a trie's retrieval and insertion)
    draft_levels: float = 0.0  # batched draft-model forwards per step (a tree's depth)
    draft_model: bool = False  # a draft model, which reads each prompt before its first draft
    draft_context: int | None = None  # the draft's cache (a StreamingLLM window); None: the sequences' own contexts
    middle_rounds: float = 0.0  # batched forwards of the target over its retrieval caches per step (TriForce)
    middle_rows: int = 1  # their new rows per sequence
    middle_context: int = 0  # their keys per sequence: the retrieval budget and a chunk
    request_seconds: float = 0.0  # paid once per request, at its first drafted step (a retrieval cache's first build)


OFF = SettingPrice(1.0)


@dataclass(frozen=True)
class LoadPrice:
    tokens_per_second: float
    wall_seconds: float
    output_tokens: int
    prefill_seconds: float  # of the wall time
    steps: int
    mean_batch: float  # sequences per step, over the steps


def closed_loop_price(profile: LatencyProfile, prompts: list[list[int]], concurrency: int, max_new_tokens: int,
                      setting_for: Callable[[int], SettingPrice], output_tokens: list[int] | None = None,
                      held: list[list[int]] | None = None) -> LoadPrice:
    """The load of `prompts` (token ids, in the order the clients take them) sent by `concurrency` closed-loop
    clients, each asking for `max_new_tokens` (or its own `output_tokens`); `setting_for(B)`: the setting of a step
    of B sequences; `held`: the tokens each slot's cache holds before the first request (default: nothing shared).
    The profile must have the target's prompt prefills and, beyond B = 1, t(B, n)."""
    if "target" not in profile.prompt_prefills:
        raise UserError("pricing a serving load needs the target's prompt prefills: profile with --batches")
    if concurrency < 1 or not prompts:
        raise UserError("a serving load needs prompts and a concurrency >= 1")
    lengths = output_tokens or [max_new_tokens] * len(prompts)
    queue = deque(range(len(prompts)))
    arrivals: deque[tuple[float, int]] = deque((0.0, queue.popleft()) for _ in range(min(concurrency, len(queue))))
    slots_held = list(held or [[] for _ in range(concurrency)])
    saved = SavedPrefixes()
    free = list(range(concurrency))
    running: list[tuple[int, int, float]] = []  # (request, slot, tokens emitted)
    now = prefill_total = 0.0
    steps = batch_total = 0
    while arrivals or running:
        joining = []
        while arrivals and arrivals[0][0] <= now and free:
            _, request = arrivals.popleft()
            slot = free.pop(max(range(len(free)), key=lambda i: (  # the longest prefix held, else the lowest slot
                _shared(slots_held[free[i]], prompts[request]), -i)))
            joining.append((request, slot))
        if joining:
            joined = setting_for(len(running) + len(joining))  # the batch they join
            in_flight = [prompts[request] for request, _, _ in running]
            seconds = 0.0
            for request, slot in joining:
                held = _copied(prompts[request], saved.reuse(slots_held[slot], prompts[request]), in_flight)
                seconds += _prefill(profile, prompts[request], held, joined)
                in_flight.append(prompts[request])
            now += seconds
            prefill_total += seconds
            running += [(request, slot, 0.0) for request, slot in joining]
        if not running:
            now = max(now, arrivals[0][0])
            continue
        batch = len(running)
        setting = setting_for(batch)
        contexts = [len(prompts[request]) + emitted for request, _, emitted in running]
        now += step_seconds(profile, batch, setting, contexts)
        steps += 1
        batch_total += batch
        still = []
        for request, slot, emitted in running:
            emitted += setting.tokens_per_step
            if emitted < lengths[request]:
                still.append((request, slot, emitted))
                continue
            slots_held[slot] = prompts[request]
            free.append(slot)
            free.sort()
            if queue:
                arrivals.append((now + CLIENT_TURNAROUND_SECONDS, queue.popleft()))
        running = still
    tokens = int(sum(lengths))
    return LoadPrice(tokens / now, now, tokens, prefill_total, steps, batch_total / max(steps, 1))


class SavedPrefixes:
    """The server's prompt cache (decoder/prompt_cache.py) as the price sees it: the prompts slots lost, every one
    kept (the memory budget holds them)."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def reuse(self, held: list[int], prompt: list[int]) -> list[int]:
        """What a slot holding `held` starts `prompt` from: its own prefix or a saved one, whichever shares more
        (`held` saved where the prompt keeps less than half of it)."""
        def shared(tokens: list[int]) -> int:
            return _shared(tokens, prompt)

        saved = max(self.prompts, key=shared, default=None)
        best = saved if saved is not None and shared(saved) > shared(held) else held
        kept = shared(held) if best is held else len(os.path.commonprefix([held, best]))
        if len(held) >= MIN_SAVED_TOKENS and 2 * kept < len(held) and held not in self.prompts:
            self.prompts.append(held)
        return best


def _copied(prompt: list[int], held: list[int], in_flight: list[list[int]]) -> list[int]:
    """What a joining request starts from where a sequence in flight, or one joining before it, holds a longer prefix
    of its prompt than `held` by MIN_SAVED_TOKENS: that prefix, copied (decoder/batching.py: Scheduler._share_prefix).
    """
    best = max(in_flight, key=lambda tokens: _shared(tokens, prompt), default=None)
    return best if best is not None and _shared(best, prompt) >= _shared(held, prompt) + MIN_SAVED_TOKENS else held


def _shared(tokens: list[int], prompt: list[int]) -> int:
    """The leading ids `tokens` holds of `prompt` but its last (the first step's root, never kept)."""
    return len(os.path.commonprefix([tokens, prompt[:-1]]))


def _prefill(profile: LatencyProfile, prompt: list[int], held: list[int], setting: SettingPrice) -> float:
    """A joining request's prefill: the target's over the prompt (all but its last token, the first step's root)
    beyond the prefix its slot holds (its own, or one the prompt cache kept); a draft model's over the whole prompt
    where the batch it joins drafts (the draft reads it at its first drafted step, charged here)."""
    shared = len(os.path.commonprefix([prompt, held]))
    seconds = profile.prompt_prefill("target", max(len(prompt) - 1 - shared, 1)) or 0.0
    if setting.draft_model:
        seconds += profile.prompt_prefill("draft", len(prompt)) or 0.0
    return seconds + setting.request_seconds


def step_seconds(profile: LatencyProfile, batch: int, setting: SettingPrice, contexts: list[float],
                 drafting: int | None = None) -> float:
    """One step of `batch` sequences under `setting` at their `contexts`, `drafting` of them drafting (default: all;
    the others one row each): t(B, n) with n the step's mean rows, the engine's overhead o(n, B), the drafters' host
    work and the draft model's levels (a TriForce middle level's rounds) over the drafting sequences alone."""
    drafting = batch if drafting is None else drafting
    rows = 1.0 + drafting * (setting.rows - 1.0) / batch
    seconds = profile.batch_latency(batch, rows, contexts) + float(profile.engine_overhead(rows, batch))
    seconds += drafting * setting.host_seconds
    if setting.draft_levels and drafting:
        draft = profile.draft_chain_seconds(drafting, setting.draft_levels,
                                            setting.draft_context or float(np.mean(contexts)))
        if draft is None:
            raise UserError(f"the profile has no draft step for {drafting} sequences: profile the draft with "
                            "--batches")
        seconds += draft
    if setting.middle_rounds and drafting:
        middle = setting.middle_rows
        seconds += setting.middle_rounds * (profile.batch_latency(drafting, middle, setting.middle_context)
                                            + float(profile.engine_overhead(middle, drafting)))
    return seconds


def mix_shares(profile: LatencyProfile, batch: int, setting: SettingPrice, context: float) -> tuple[float, ...]:
    """What k of a step's `batch` sequences drafting `setting` add to its plain step, as shares of what all of them
    add, at each k of `mix_points` (BatchSchedule.mix_shares); none where drafting adds nothing."""
    plain = step_seconds(profile, batch, setting, [context], drafting=0)
    added = step_seconds(profile, batch, setting, [context]) - plain
    if added <= 0:
        return ()
    return tuple(min(1.0, max(0.0, (step_seconds(profile, batch, setting, [context], k) - plain) / added))
                 for k in mix_points(batch))


def ragged_step_seconds(profile: LatencyProfile, slots: tuple[tuple[int, int], ...], price: SettingPrice,
                        context: int) -> float:
    """llama-server's step of one sequence per entry of `slots`, each (its target rows, its draft model's decodes):
    the sum of the steps of each group of slots with equal rows, as if each group ran its own forward; where `price`
    drafts with a model, plus the draft's work, which llama-server batches over the slots (docs/design.md): its
    re-decoding of every slot's verified rows, then one batched decode per draft position of the slots still
    drafting there, each priced as its share of the profile's measured work (`LatencyProfile.draft_chain_seconds`:
    per batch size a line in the decodes, its slope a decode's; else one batched draft step each). Timed with some
    slots drafting beside plain ones (docs/benchmark-log.md, "llama-server's ragged steps"), the target's step costs
    about that sum, far above t(B, n) of the batch's mean rows, which priced drafts that then lost to no drafting."""
    return _RaggedPrices(profile, price, context).step(slots)


def mean_ragged_step(profile: LatencyProfile, steps: np.ndarray, batch: int, price: SettingPrice, context: int,
                     rng: np.random.Generator) -> float:
    """The mean `ragged_step_seconds` of `batch` sequences each at one of a replay's `steps` ([steps, 2]: the target's
    rows and the draft's decodes of each): over the steps themselves at B = 1, over BATCH_DRAWS batches of B of them
    drawn at random beyond."""
    draws = steps[:, None] if batch == 1 else steps[rng.choice(len(steps), (BATCH_DRAWS, batch))]
    mixes = Counter(tuple(sorted(map(tuple, draw))) for draw in draws.tolist())
    prices = _RaggedPrices(profile, price, context)
    return sum(count * prices.step(mix) for mix, count in mixes.items()) / len(draws)


class _RaggedPrices:
    """`ragged_step_seconds` under one setting, each group's price computed once (a batch size's draws repeat them)."""

    def __init__(self, profile: LatencyProfile, price: SettingPrice, context: int) -> None:
        self.profile, self.price, self.context = profile, price, context
        self.group = functools.cache(self._group)
        self.draft = functools.cache(self._draft)

    def step(self, slots: tuple[tuple[int, int], ...]) -> float:
        seconds = sum(self.group(count, rows) for rows, count in Counter(rows for rows, _ in slots).items())
        if not self.price.draft_model:
            return seconds
        decodes = np.array([decodes for _, decodes in slots])
        # every slot's verified rows re-decoded: inside the measured work's intercept, else one more batched draft step
        seconds += self.draft(len(slots), 0 if self.profile.draft_chains else 1)
        for position in range(1, int(decodes.max(initial=0)) + 1):  # one batched decode of the slots drafting so far
            drafting = int((decodes >= position).sum())
            seconds += self.draft(drafting, 1) - self.draft(drafting, 0)
        return seconds

    def _group(self, count: int, rows: int) -> float:
        return step_seconds(self.profile, count, replace(self.price, rows=float(rows), draft_levels=0.0),
                            [self.context])

    def _draft(self, batch: int, decodes: int) -> float:
        work = self.profile.draft_chain_seconds(batch, decodes, self.context)
        if work is None:
            raise UserError(f"the profile has no draft step for {batch} sequences: profile the draft with --batches")
        return work


def schedule_table(prices: dict[int, SettingPrice], profile: LatencyProfile, largest: int, context: int,
                   method: str, min_speedup: float = MIN_SPEEDUP,
                   priced_step: Callable[[int, int, SettingPrice], float] | None = None,
                   exact: tuple[int, float] | None = None) -> tuple[BatchSchedule, dict[str, list[float | None]]]:
    """At each batch size 1..`largest`, the setting of `prices` (keyed by decoding length: nodes per sequence, root
    included) giving the most output tokens/s over the batch at `context` if that is at least `min_speedup` times
    none's (below 1: drafting even where predicted slower), else none, which keeps that setting as its candidate where
    it is predicted at least CANDIDATE_SPEEDUP times none's (core/plan_schema.py: Candidate); ranges of equal settings
    merged. `priced_step(batch, length, price)`: a setting's step in seconds (default: `step_seconds` at its rows).
    `exact`: (a length whose price replays the acceptance exactly, a margin): another setting, priced approximately,
    replaces it at a batch size only where predicted faster by more than the margin.
    Also every setting's tokens/s per batch size ({"off": [...], "L_d=4": [...]}, named as `method` names them; None:
    rows beyond what was profiled at that batch size)."""
    def at_its_rows(batch: int, _: int, price: SettingPrice) -> float:
        return step_seconds(profile, batch, price, [context])

    priced_step = priced_step or at_its_rows
    chosen: list[tuple[int | None, float, float, float, Candidate | None]] = []  # per B (BatchSchedule.merged)
    name = {length: setting_name(method, length) for length in prices}
    rates: dict[str, list[float | None]] = {"off": [], **{name[d]: [] for d in prices}}
    drafts = any(price.draft_levels for price in prices.values())
    shares: list[tuple[float, ...]] = []  # per B: its mix's (BatchSchedule.mix_shares)
    for batch in range(1, largest + 1):
        if drafts and profile.draft_chain_seconds(batch, 1, context) is None:
            raise UserError(f"the profile has no draft step for {batch} sequences: profile the draft with --batches")
        off = batch / step_seconds(profile, batch, OFF, [context])
        rates["off"].append(off)
        best: tuple[int | None, float, float] = (None, 1.0, 0.0)  # the best drafted setting
        exact_best = None
        for length, price in prices.items():
            try:
                rate = batch * price.tokens_per_step / priced_step(batch, length, price)
            except (UserError, ValueError):  # B x n beyond the rows profiled at this batch size
                rates[name[length]].append(None)
                continue
            rates[name[length]].append(rate)
            if rate > best[2]:
                best = (length, price.tokens_per_step, rate)
            if exact is not None and length == exact[0]:
                exact_best = (length, price.tokens_per_step, rate)
        if exact_best is not None and best[2] <= exact_best[2] * (1.0 + exact[1]):
            best = exact_best
        length, per_step, rate = best
        shares.append(mix_shares(profile, batch, prices[length], context) if length is not None else ())
        if length is not None and rate >= min_speedup * off:
            chosen.append((length, per_step, rate, rate / off, None))
        else:
            candidate = (Candidate(length, per_step, rate / off)
                         if length is not None and rate >= CANDIDATE_SPEEDUP * off else None)
            chosen.append((None, 1.0, off, 1.0, candidate))
    return BatchSchedule.merged(context, chosen, tuple(shares)), rates
