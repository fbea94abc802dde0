"""Continuous batching: many requests decoded together, one target forward per step for every sequence in flight.

Each sequence has a slot: its own target cache (the model's "target.<slot>" cache), its own drafter (a draft
model's cache, a Lookahead trie, TriForce's retrieval and StreamingLLM caches), its own random stream. A step
collects every sequence's draft tree and scores them in one forward (LeanModel.forward_many: the projections and
MLP over all the rows, attention per sequence over its own keys with its tree mask), then verifies, commits and
stops each sequence alone (decoder/engine.py: SequenceRun). Between steps finished sequences leave and free their
slots, and waiting requests join: the prompts admitted together are prefilled together in one batched forward
(each prompt over its own cache; a prompt longer than a prefill chunk alone, in chunks), before the next step; or,
with a `prefill_chunk`, their prompts ride along the decode steps, at most that many prompt tokens a step, so that
the sequences in flight keep decoding while a request joins (vLLM's chunked prefill). A
slot's cache keeps what its last sequence left, so that a prompt sharing a prefix with it (a chat template's system
turn, a conversation's earlier turns) prefills only the rest, as llama-server's slots reuse their prompt caches: a
joining request takes the free slot holding the longest prefix of its prompt, and what a slot would lose is saved in
host memory, where any slot's later request may start from it (decoder/prompt_cache.py, llama-server's --cache-ram).
A joining request whose prompt shares a long prefix with a sequence in flight (questions over one document, sent at
once) copies it from that sequence's cache, and waits for it where that sequence is still computing it (SGLang 0.5.23's
radix cache shares a running request's prefix, and its scheduler defers a waiting request whose prefix another waiting
one will compute: `IN_BATCH_PREFIX_CACHING_*` in srt/managers/schedule_policy.py).
A request's tokens do not depend on who shares its steps: greedy output is its own one-request greedy output, and
sampled output is drawn from its own seeded stream.

A slot's drafter stays with the slot across the requests it serves, so a Lookahead trie keeps learning from the
outputs of its slot (with one slot: exactly the one-request decoder and its offline replay).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from specplan.core.choices import DEFAULT_PROMPT_CACHE_MIB, MIN_SAVED_TOKENS
from specplan.core.errors import UserError
from specplan.decoder.drafters import Drafter, propose_all
from specplan.decoder.engine import GenerationResult, SequenceRun, SpeculativeEngine, draft_passes
from specplan.decoder.gate import UNTIMED_AFTER_JOIN, DraftPasses, RecentYields
from specplan.decoder.model import ForwardItem, prefill_together, prompt_item
from specplan.decoder.prompt_cache import PromptCache, copy_prefix, shared_prefix
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.tree import DraftTree

# Prompts up to this many tokens join one batched prefill when several requests are admitted at once; longer ones are
# prefilled alone in chunks (LeanModel.prefill), as one request's prompt always is.
PREFILL_TOGETHER_TOKENS = 512
# The last steps whose most sequences a drafter's reading is priced at (DraftGate.drafts: `load`): enough to span the
# tail of a closed loop's level (its requests finishing a few steps apart) into the next level's first step, where one
# request runs alone before its burst joins; few enough that an engine whose load fell prices at the new one soon
LOAD_STEPS = 32


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    on_tokens: Callable[[list[int]], None] | None = None  # called with each step's emitted tokens (streaming)
    ignore_eos: bool = False  # runs to max_new_tokens past the stop tokens (vLLM's and llama-server's ignore_eos)


@dataclass
class Completion:
    """A finished request: its result, or the one-line reason it failed (it failed alone)."""

    id: int
    result: GenerationResult | None
    error: str | None = None
    first_token_seconds: float | None = None  # from submission to the first emitted token (queueing included)
    cancelled: bool = False


@dataclass
class StepRecord:
    """One scheduler step as a step log sees it (`Scheduler.step_log`): when it began (time.perf_counter), its seconds
    to the next step's start (the server's work between them, and the prefills of the requests admitted then,
    included), its sequences and how many drafted, the kind its engine's clock counts it as (None: some sequences
    drafted, too few to count), whether the clock timed it, the requests that finished in it and those admitted before
    the next, and the prices its requests decided at: the mean over its gated requests of a drafted step's price in
    plain steps and of the tokens each expected of one (None without gates)."""

    started: float
    batch: int
    drafted: int
    kind: str | None
    price: float | None
    expected: float | None
    prompt_chunks: int = 0
    seconds: float = 0.0
    timed: bool = False
    finished: int = 0
    admitted_after: int = 0
    clock_price: float | None = None  # the clock's measured price at its batch size once it was timed (or not)


@dataclass
class _Waiting:
    id: int
    request: Request
    submitted: float


@dataclass(eq=False)
class _Running:
    id: int
    slot: int
    run: SequenceRun
    submitted: float
    prompt: list[int] = field(default_factory=list)
    admitted: float = field(default_factory=time.perf_counter)


class Scheduler:
    """Requests in, completions out: `submit` queues one, `step` admits waiting requests into free slots (prefilling
    each) and advances every running sequence by one speculative step; `run` does both over a list."""

    def __init__(self, engine: SpeculativeEngine, drafter_for_slot: Callable[[int], Drafter], concurrency: int,
                 prefill_chunk: int = 0, prompt_cache_mib: int = DEFAULT_PROMPT_CACHE_MIB) -> None:
        if concurrency < 1:
            raise UserError(f"the concurrency must be >= 1, got {concurrency}")
        if prefill_chunk < 0:
            raise UserError(f"the prefill chunk must be >= 0 tokens (0: prefill on admission), got {prefill_chunk}")
        if concurrency > 1 and not hasattr(engine.target, "forward_many"):
            raise UserError(f"the {engine.target.backend} backend decodes one sequence at a time; run the lean "
                            "backend for a concurrency above 1")
        self.engine = engine
        self.drafter_for_slot = drafter_for_slot
        self.concurrency = concurrency
        self.waiting: deque[_Waiting] = deque()
        self.running: list[_Running] = []
        self.prefill_chunk = prefill_chunk if hasattr(engine.target, "forward_many") else 0
        self.prefilling: list[_Running] = []  # admitted, their prompts entering the cache along the steps (FIFO)
        self.free_slots = list(range(concurrency))
        self.cancelled: set[int] = set()
        self.step_done: list[Completion] = []
        self.next_id = 0
        # the last step: (sequences, drafted, its start, later by the seconds its drafters read before drafting, its
        # drafters' passes where they follow the text)
        self.timed_step: tuple[int, bool | None, float, DraftPasses | None] | None = None
        self.steps_since_join = 0  # steps begun since a sequence last joined the running batch (UNTIMED_AFTER_JOIN)
        self.recent_batches: deque[int] = deque(maxlen=LOAD_STEPS)  # the sequences of the last steps, idle or not
        # the mean yield ratio of the last step's requests with drafted steps (decoder/gate.py): a joiner's prior;
        # None once the engine is idle, when a joiner's prior is the engine's recent drafted steps'
        self.batch_yield: float | None = None
        self.recent_yields = RecentYields()
        self.step_log: Callable[[StepRecord], None] | None = None  # handed every step once its seconds are known
        self.logged_step: StepRecord | None = None  # the last step, its seconds not known yet
        target = engine.target
        # prefixes kept in the slots' caches: on the CPU kernels only (CUDA graphs are captured per cache state),
        # and where a prefix's keys do not depend on the whole prompt (RoPE scaled by the prompt's length; Phi-3)
        self.keep_prefixes = (getattr(target, "kernels", None) is not None and target.graphed is None
                              and target.long_rope is None and not target.position_dependent_rope)
        # prefixes the slots would lose, kept in host memory for any slot's later request
        self.prompt_cache = (PromptCache(prompt_cache_mib * 2**20) if self.keep_prefixes and prompt_cache_mib > 0
                             else None)

    def submit(self, request: Request) -> int:
        self.waiting.append(_Waiting(self.next_id, request, time.perf_counter()))
        self.next_id += 1
        return self.next_id - 1

    def cancel(self, request_id: int) -> None:
        """Drop a request (a client went away): waiting, it never starts; running, its slot is freed at the next
        step."""
        self.cancelled.add(request_id)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.prefilling

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        done: list[Completion] = []
        self.step_done = done  # what this step completed so far, which `abort` hands out if the step raises
        self.running = [entry for entry in self.running if not self._drop_if_cancelled(entry, done)]
        self.prefilling = [entry for entry in self.prefilling if not self._drop_if_cancelled(entry, done)]
        waiting = len(self.waiting)
        done += self._admit()
        admitted = waiting - len(self.waiting)
        if admitted:  # the time since the last step's start holds prefills: not a step's cost
            self.timed_step = None
        self._prefilled([])  # prompts their slots' kept prefixes already hold
        running = self.running
        chunks = self._prompt_chunks()
        if not running and not chunks:
            self.timed_step = None
            self._log_last_step(time.perf_counter(), admitted, False)
            return done
        started = time.perf_counter()
        self._log_last_step(started, admitted, self._time_last_step(started))
        if self.engine.clock is not None:
            self.engine.clock.begin_step()
        self.recent_yields.step += 1
        self.recent_batches.append(len(running))
        self.engine.decide([entry.run for entry in running], max(self.recent_batches))
        gated = [entry.run for entry in running if entry.run.gate is not None]
        drafting_started = time.perf_counter()
        items = [run.propose(tree) for run, tree in zip((entry.run for entry in running), _draft(running))]
        drafting_seconds = time.perf_counter() - drafting_started
        # the step's kind for the clock: drafted where at least half the sequences chose to draft (where a few sit
        # out, the step costs nearly what one where all draft does, and a batch whose joiners' draft models have their
        # prompts still to read may never have another drafted step to time), though a trie without a match drafts
        # nothing (at 8 in flight most drafted steps hold one; DraftGate.observe counts its one token) unless it is
        # the only sequence, whose step then cost a plain one; plain where no tree has a draft token
        trees = {entry.run.tree.size > 1 for entry in running}
        choosing = sum(entry.run.drafter.drafts_now() for entry in running)
        drafted = 2 * choosing >= len(running) and (len(running) > 1 or True in trees)
        kind = True if drafted else False if trees == {False} else None
        starting = any(entry.run.drafter.started_now for entry in running if entry.run.tree.size > 1)
        reading = sum(entry.run.drafter.reading_seconds for entry in running if entry.run.tree.size > 1)
        past_join = self.steps_since_join >= UNTIMED_AFTER_JOIN
        passes = draft_passes([entry.run for entry in running], drafting_seconds - reading)
        self.timed_step = (len(running), kind, started + reading, passes) \
            if past_join and not chunks and not starting else None
        self.steps_since_join += 1
        if self.step_log is not None:
            self.logged_step = _step_record(started, running, kind, len(chunks))
        items += [item for _, item in chunks]
        target = self.engine.target
        logits = target.forward_many(items) if len(items) > 1 else [target.forward(*items[0])]
        self.running = []
        for entry, scored in zip(running, logits):
            if entry.run.advance(scored):
                done.append(self._complete(entry))
            else:
                self.running.append(entry)
        if self.logged_step is not None:
            self.logged_step.finished = len(running) - len(self.running)
        self._prefilled(chunks)
        measured = [run.gate.yield_ratio for run in gated if run.gate.yields]
        if not self.running:  # idle: the next request's load is not this one's
            self.batch_yield = None
        elif measured:
            self.batch_yield = statistics.fmean(measured)
        return done

    def _log_last_step(self, now: float, admitted: int, timed: bool) -> None:
        """The last step to the step log, its seconds ending `now`, `admitted` requests prefilled since."""
        record, self.logged_step = self.logged_step, None
        if record is None or self.step_log is None:
            return
        record.seconds, record.timed, record.admitted_after = now - record.started, timed, admitted
        clock = self.engine.clock
        record.clock_price = clock.drafted_step_cost(record.batch) if clock is not None else None
        self.step_log(record)

    def _time_last_step(self, now: float) -> bool:
        """The last step's seconds, from its start to this one's (the server's work between them included), to the
        engine's clock: a step in which at least half the sequences chose to draft (a trie without a match drafting
        nothing) or none drafted, no prompt prefilled since, none of the UNTIMED_AFTER_JOIN after a sequence joined
        (decoder/gate.py), no drafter starting its sequence untimed
        (Drafter.started_now); less what its drafters read before drafting (Drafter.started_reading). With shared rows,
        every such step, whatever its kind, to the sharing's step prices (decoder/sharing.py)."""
        clock, sharing = self.engine.clock, self.engine.sharing
        recorded = False
        if self.timed_step is not None:
            batch, drafted, started, passes = self.timed_step
            if clock is not None and drafted is not None:
                recorded = clock.step_done(batch, drafted, now - started, passes)
            if sharing is not None:  # a step whose rows were shared: its time against the table's price
                sharing.timed(now - started)
        return recorded

    def _prompt_chunks(self) -> list[tuple[_Running, ForwardItem]]:
        """With a prefill chunk: the next prompt tokens of the sequences prefilling, oldest first, at most
        `prefill_chunk` in all, each a causal item over its own cache (no logits: the prompt's last token is the
        first step's root)."""
        chunks, budget = [], self.prefill_chunk
        for index, entry in enumerate(self.prefilling):
            if budget == 0:
                break
            self._share_prefix(entry)
            cache = entry.run.cache
            n = min(budget, len(entry.prompt) - 1 - cache.length)
            if n <= 0 or self._waits(entry, self.prefilling[:index]):
                continue  # its prompt all copied (it starts after this step), or its prefix still being computed
            tokens = torch.tensor(entry.prompt[cache.length:cache.length + n])
            chunks.append((entry, prompt_item(self.engine.target, tokens, cache)))
            budget -= n
        return chunks

    def _prefilled(self, chunks: list[tuple[_Running, ForwardItem]]) -> None:
        """Commit the prompt chunks just scored; a sequence whose prompt is all in its cache starts decoding."""
        for entry, item in chunks:
            entry.run.cache.commit(None, item.tokens.shape[0])
        still = []
        for entry in self.prefilling:
            if entry.run.cache.length == len(entry.prompt) - 1:
                entry.run.prefill(entry.prompt, prefilled=True)
                entry.run.prefill_seconds = entry.run.started - entry.admitted  # steps shared with others included
                self.running.append(entry)
                self.steps_since_join = 0
            else:
                still.append(entry)
        self.prefilling = still

    def run(self, requests: Iterable[Request]) -> Iterator[Completion]:
        """Submit every request, then step until all are done; completions in the order they finish."""
        for request in requests:
            self.submit(request)
        while not self.idle:
            yield from self.step()

    def _admit(self) -> list[Completion]:
        """Waiting requests into free slots: each one's cache and drafter readied, the prompts that fit one prefill
        chunk prefilled together in one batched forward (the others alone), then each drafter started."""
        failed, joining = [], []
        while self.waiting and self.free_slots:
            waiting = self.waiting.popleft()
            if waiting.id in self.cancelled:
                self.cancelled.discard(waiting.id)
                failed.append(Completion(waiting.id, None, "cancelled", cancelled=True))
                continue
            request = waiting.request
            slot = self._slot_for(request.prompt)
            role = _target_role(slot)
            held = self.engine.target.kept_cache(role) if self.prompt_cache is not None else None
            if held is not None:
                self.prompt_cache.reuse(held, request.prompt)
            try:
                run = self.engine.start(request.prompt, request.max_new_tokens, request.params, request.seed,
                                        request.on_tokens, self.drafter_for_slot(slot), role, prefill=False,
                                        keep_prefix=self.keep_prefixes, ignore_eos=request.ignore_eos)
            except UserError as exc:  # this request fails alone
                self.free_slots.insert(0, slot)
                failed.append(Completion(waiting.id, None, str(exc)))
                continue
            if run.gate is not None:
                run.gate.join(self.recent_yields, self.batch_yield, adds_to_recent=not request.ignore_eos)
            joining.append(_Running(waiting.id, slot, run, waiting.submitted, request.prompt))
        if self.prefill_chunk:
            for entry in joining:
                entry.run.cache.prompt_length = len(entry.prompt)
            self.prefilling.extend(joining)
            return failed
        self.running.extend(joining)  # before their prefills: a prefill that raises fails them (abort), not lost
        if joining:
            self.steps_since_join = 0
        pending = joining
        while pending:  # in waves: a prompt sharing a prefix with an earlier one waits to copy it (_waits)
            for entry in pending:
                self._share_prefix(entry)
            wave = [entry for index, entry in enumerate(pending) if not self._waits(entry, pending[:index])]
            self._prefill(wave)
            pending = [entry for entry in pending if entry not in wave]
        return failed

    def _prefill(self, joining: list[_Running]) -> None:
        """The prompts that fit one prefill chunk prefilled together in one batched forward, the others alone."""
        together = [entry for entry in joining
                    if 0 < len(entry.prompt) - 1 - entry.run.cache.length <= PREFILL_TOGETHER_TOKENS]
        if len(together) > 1 and hasattr(self.engine.target, "forward_many"):
            start = time.perf_counter()
            prefill_together(self.engine.target, [torch.tensor(e.prompt[e.run.cache.length:-1]) for e in together],
                             [e.run.cache for e in together], [len(e.prompt) for e in together])
            seconds = time.perf_counter() - start
            for entry in together:
                entry.run.prefill(entry.prompt, prefilled=True)
                entry.run.prefill_seconds = seconds
        else:
            together = []
        for entry in joining:
            if entry not in together:
                entry.run.prefill(entry.prompt)

    def _share_prefix(self, entry: _Running) -> None:
        """Copy into a joining request's cache the longest prefix of its prompt that a sequence in flight holds (its
        prompt and output so far), where that beats what its cache holds by MIN_SAVED_TOKENS (decoder/prompt_cache.py:
        copy_prefix)."""
        cache = entry.run.cache
        if not self._shares_prefixes(entry):
            return
        wanted = np.asarray(entry.prompt[:-1], dtype=np.int64)
        best, best_shared = None, cache.length + MIN_SAVED_TOKENS - 1
        for other in self.running + self.prefilling:
            if other is entry or not self._shares_prefixes(other):
                continue
            held = np.asarray((other.prompt + other.run.out)[:other.run.cache.length], dtype=np.int64)
            shared = shared_prefix(held, wanted)
            if shared > best_shared:
                best, best_shared = other, shared
        if best is not None:
            copy_prefix(best.run.cache, cache, best_shared)
            entry.run.cached_prompt_tokens = best_shared

    def _waits(self, entry: _Running, earlier: list[_Running]) -> bool:
        """Whether a joining request should wait for an earlier one to compute a prefix of its prompt (at least
        MIN_SAVED_TOKENS beyond what its cache holds), to copy it then (`_share_prefix`) instead of computing it too."""
        if not self._shares_prefixes(entry):
            return False
        wanted = np.asarray(entry.prompt[:-1], dtype=np.int64)
        for other in earlier:
            shared = shared_prefix(np.asarray(other.prompt[:-1], dtype=np.int64), wanted)
            if other.run.cache.length < shared and shared - entry.run.cache.length >= MIN_SAVED_TOKENS:
                return True
        return False

    def _shares_prefixes(self, entry: _Running) -> bool:
        """Whether a sequence's cache may give and take prefixes: slots that are positions, where slots are kept."""
        return self.keep_prefixes and entry.run.cache.key_positions is None

    def _slot_for(self, prompt: list[int]) -> int:
        """The free slot a request takes: the one whose cache holds the longest prefix of its prompt (llama-server's
        choice by prompt similarity), else the lowest."""
        best, shared = 0, 0
        if self.keep_prefixes:
            wanted = np.asarray(prompt[:-1], dtype=np.int64)
            for index, slot in enumerate(self.free_slots):
                cache = self.engine.target.kept_cache(_target_role(slot))
                if cache is not None and cache.held is not None:
                    held = shared_prefix(np.asarray(cache.held[:cache.length], dtype=np.int64), wanted)
                    if held > shared:
                        best, shared = index, held
        return self.free_slots.pop(best)

    def abort(self, reason: str) -> list[Completion]:
        """After a step that raised: the completions it had made, and every sequence in flight failed with `reason`
        (their drafters may be half-way through the step), their slots freed, each cache keeping what it committed;
        the waiting requests start at the next step."""
        failed, self.step_done = self.step_done, []
        for entry in self.running + self.prefilling:
            self._leave(entry)
            failed.append(Completion(entry.id, None, reason))
        self.running, self.prefilling = [], []
        self.batch_yield = None
        self.free_slots.sort()
        return failed

    def _drop_if_cancelled(self, entry: _Running, done: list[Completion]) -> bool:
        if entry.id not in self.cancelled:
            return False
        self.cancelled.discard(entry.id)
        self._leave(entry)
        done.append(Completion(entry.id, entry.run.result(), "cancelled", cancelled=True))
        return True

    def _complete(self, entry: _Running) -> Completion:
        self._leave(entry)
        self.free_slots.sort()
        run = entry.run
        first = None if run.first_token_at is None else run.first_token_at - entry.submitted
        return Completion(entry.id, run.result(), None, first)

    def _leave(self, entry: _Running) -> None:
        """A sequence out of its slot: its drafter finished, the slot free, its cache's tokens noted for the next."""
        run = entry.run
        run.drafter.finish()
        if self.keep_prefixes:
            run.cache.held = (entry.prompt + run.out)[:run.cache.length]
        self.free_slots.append(entry.slot)


def _target_role(slot: int) -> str:
    """The target cache's role of a slot (slot 0: the one-request decoder's own, "target")."""
    return "target" + (f".{slot}" if slot else "")


def _step_record(started: float, running: list[_Running], kind: bool | None, prompt_chunks: int) -> StepRecord:
    gates = [entry.run.gate for entry in running if entry.run.gate is not None and entry.run.gate.priced is not None]
    return StepRecord(started, len(running), sum(entry.run.tree.size > 1 for entry in running),
                      None if kind is None else "drafted" if kind else "plain",
                      statistics.fmean(g.step_cost for g in gates) if gates else None,
                      statistics.fmean(g.expected for g in gates) if gates else None, prompt_chunks)


def _draft(running: list[_Running]) -> list[DraftTree]:
    runs = [entry.run for entry in running]
    return propose_all([r.drafter for r in runs], [r.root for r in runs], [r.params for r in runs],
                       [r.rule.draw for r in runs], [r.generator for r in runs])
