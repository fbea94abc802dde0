"""The verification engine: a drafter proposes a token tree, the target scores it in one forward over its static
KV cache, a verification rule walks it, and the cache keeps the accepted path. Autoregressive decoding is the
same loop with a one-node tree."""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from specplan.core.errors import UserError
from specplan.core.plan_schema import BatchSchedule
from specplan.decoder.drafters import Drafter, NoDrafter
from specplan.decoder.gate import UNTIMED_AFTER_JOIN, DraftGate, DraftPasses, Pricing, StepClock, settle_step
from specplan.decoder.model import ForwardItem, KVCache, LeanModel
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.sharing import SharedRows
from specplan.decoder.tree import DraftTree, ancestor_matrix, tree_attention_mask
from specplan.decoder.verify import VerificationRule, choose_rule


@dataclass
class GenerationResult:
    tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    steps: int
    accepted_per_step: list[int] = field(default_factory=list)  # tokens emitted per target forward
    stop_reason: str = "length"
    drafted_per_step: list[int] = field(default_factory=list)  # draft nodes each forward scored beside its root
    # the per-request decisions' steps by why ("pays: drafts", "sits out: plain"; decoder/gate.py REASONS); {} ungated
    decisions: dict[str, int] = field(default_factory=dict)
    cached_prompt_tokens: int = 0  # of the prompt, those its slot's cache held (a kept prefix), not prefilled
    # per batch size its decisions were made at: the median price of a drafted step in plain steps (the clock's where it
    # had timed one, else the plan's) and the median tokens the request expected of it (DraftGate); {} ungated
    step_prices: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def drafted_steps(self) -> int:
        """The target forwards in which the request drafted (scored draft tokens beside its root)."""
        return sum(1 for drafted in self.drafted_per_step if drafted)

    @property
    def tokens_per_step(self) -> float:
        return len(self.tokens) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0


class TreeMasks:
    """Additive attention masks of draft trees, their ancestor matrices kept by shape (a Lookahead trie retrieves a
    few shapes over and over)."""

    KEPT_SHAPES = 256

    def __init__(self) -> None:
        self._allowed: dict[tuple[int, ...], torch.Tensor] = {}

    def mask(self, parents: list[int], prefix: int, dtype: torch.dtype) -> torch.Tensor:
        key = tuple(parents)
        allowed = self._allowed.get(key)
        if allowed is None:
            allowed = self._allowed[key] = ancestor_matrix(parents)
            if len(self._allowed) > self.KEPT_SHAPES:
                self._allowed.clear()
        return tree_attention_mask(allowed, prefix, dtype)


class SequenceRun:
    """One generation in flight: its target cache, drafter, random stream and output. Each step `propose` gives the
    tree the target scores next (as a forward's item) and `advance` takes its logits: verification, commit, stop
    handling and what the drafter learns, for this sequence alone, whoever shares the forward."""

    def __init__(self, target: LeanModel, drafter: Drafter, cache: KVCache, rule: VerificationRule,
                 params: SamplingParams, seed: int | None, max_new_tokens: int, stop_ids: set[int],
                 masks: TreeMasks, on_tokens: Callable[[list[int]], None] | None = None,
                 pricing: Pricing | None = None, schedule: BatchSchedule | None = None,
                 clock: StepClock | None = None, sharing: SharedRows | None = None) -> None:
        self.target, self.drafter, self.cache, self.rule, self.params = target, drafter, cache, rule, params
        self.schedule = schedule
        self.sharing = sharing  # the engine's, which decides this request's rows and learns from its surveys
        # whether to draft at each step, from this request's own drafts (decoder/gate.py)
        self.gate = (DraftGate(pricing, clock, drafter.shadows,
                               schedule.mix_share if schedule is not None else None)
                     if pricing is not None and drafter.gated and sharing is None else None)
        self.clock = clock
        drafter.drafting = True
        self.generator = torch.Generator(device=target.device).manual_seed(seed if seed is not None else 0)
        self.max_new_tokens, self.stop_ids, self.masks, self.on_tokens = max_new_tokens, stop_ids, masks, on_tokens
        self.out: list[int] = []
        self.accepted_per_step: list[int] = []
        self.drafted_per_step: list[int] = []
        self.decisions: Counter[str] = Counter()
        self.prices: dict[int, list[tuple[float, float]]] = defaultdict(list)  # batch -> (step cost, expected tokens)
        self.stop_reason = "length"
        self.root = -1
        self.batch = 1  # sequences in the coming step (decide)
        self.tree: DraftTree | None = None
        self.prefill_seconds = 0.0
        self.cached_prompt_tokens = cache.length  # a prefix the slot's cache kept (KVCache.keep_prefix)
        self.started = 0.0  # when decoding began (perf_counter)
        self.first_token_at: float | None = None  # when the first token was emitted (perf_counter)

    def prefill(self, prompt: list[int], prefilled: bool = False) -> None:
        """The prompt's tokens but the last into the target cache (unless `prefilled`: a batch prefilled them
        together, decoder/batching.py); the drafter starts the sequence."""
        start = time.perf_counter()
        if not prefilled:  # after any prefix the cache kept (SpeculativeEngine.start's `keep_prefix`)
            self.target.prefill(torch.tensor(prompt[self.cache.length:-1], dtype=torch.long), self.cache,
                                logits=False, prompt_length=len(prompt))
        self.started = time.perf_counter()
        self.prefill_seconds = self.started - start
        # The drafter's own prefill (a draft model's prompt, a StreamingLLM window) is a cost of speculating,
        # which one-token decoding does not pay: it counts as decoding time.
        self.drafter.reset(prompt, self.cache.max_len)
        self.drafter.bind(self.cache)
        self.root = prompt[-1]

    def decide(self, batch: int, load: int | None = None) -> None:
        """How much this request drafts at the coming step of `batch` sequences (an engine's rule, else the schedule's
        setting there, at its own context), and whether it drafts at all (always, without a gate; `load`: the most
        sequences the engine ran at recently, which its drafter's reading is priced at: DraftGate.drafts)."""
        self.batch = batch
        if self.drafter.rule is not None:
            self.drafter.draft_nodes(self.drafter.rule.tokens(batch) + 1)
        elif self.schedule is not None:
            self.drafter.follow(self.schedule.entry_for(batch, self.cache.length), gated=self.gate is not None)
        if self.gate is not None:
            self.drafter.drafting = self.gate.drafts(batch, self.cache.length, self.drafter.start_tokens(),
                                                     self.max_new_tokens - len(self.out), load)
            if self.drafter.drafting and self.gate.priced is not None and not self.drafter.drafts_now():
                self.gate.not_ready()
                self.drafter.drafting = False

    def propose(self, tree: DraftTree | None = None) -> ForwardItem:
        """The next tree to score (proposed by the drafter unless given: a batch's drafts made together)."""
        drafts_now = self.drafter.drafts_now()
        if tree is None:
            tree = (self.drafter.propose(self.root, self.params, self.rule.draw, self.generator)
                    if drafts_now else self.drafter.idle(self.root))
        self.tree = tree
        prefix = self.cache.length
        positions = prefix + torch.tensor(tree.depths)
        mask = self.masks.mask(tree.parents, prefix, self.target.dtype) if tree.size > 1 else None
        return ForwardItem(torch.tensor(tree.tokens), positions, self.cache, mask)

    def advance(self, logits: torch.Tensor) -> bool:
        """Verify the proposed tree against the target's `logits` ([tree size, vocab]); True when finished."""
        tree, cache = self.tree, self.cache
        path, next_token = self.rule.walk(tree, logits, self.params, self.generator)
        contiguous = path == list(range(len(path)))
        cache.commit(None if contiguous else torch.tensor(path), len(path))
        new = [tree.tokens[v] for v in path[1:]] + [next_token]
        self.accepted_per_step.append(len(new))
        self.drafted_per_step.append(tree.size - 1)
        if self.clock is not None and self.drafter.started_reading is not None:
            self.clock.record_start(*self.drafter.started_reading)
            self.drafter.started_reading = None
        if self.sharing is not None:
            self.sharing.emitted(self.drafter, len(new))
        if self.gate is not None:
            self.gate.observe(len(new), tree.size - 1, self.drafter.draft_passes)
            self.decisions[f"{self.gate.reason}: {'drafts' if self.gate.drafting else 'plain'}"] += 1
            if self.gate.reason != "unpriced":
                self.prices[self.gate.batch].append((self.gate.step_cost, self.gate.expected))
        if self.drafter.rule is not None:
            self.drafter.rule.observe(tree.size - 1, len(path) - 1, self.batch)
        keep = min(self.max_new_tokens - len(self.out),
                   next((i + 1 for i, t in enumerate(new) if t in self.stop_ids), len(new)))
        if any(t in self.stop_ids for t in new[:keep]):
            self.stop_reason = "stop"
        # The drafter learns exactly the emitted tokens (a trie must not see tokens past the end).
        if keep < len(new):
            self.drafter.update(tree, path[:keep + 1], None)
        else:
            self.drafter.update(tree, path, next_token)
        for shadow in self.drafter.shadow_yields():  # drained every step, whether or not anything reads them
            if self.gate is not None:
                self.gate.observe_shadow(shadow.emitted, shadow.matched)
            if self.sharing is not None:
                self.sharing.observe(shadow)
        shadow_passes = self.drafter.shadow_passes()  # drained whether or not a gate reads them
        if self.gate is not None and shadow_passes:
            self.gate.observe_shadow_passes(shadow_passes)
        self.out.extend(new[:keep])
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self.on_tokens is not None:
            self.on_tokens(new[:keep])
        self.root = next_token
        return self.stop_reason == "stop" or len(self.out) >= self.max_new_tokens

    def result(self) -> GenerationResult:
        return GenerationResult(self.out, self.prefill_seconds, time.perf_counter() - self.started,
                                len(self.accepted_per_step), self.accepted_per_step, self.stop_reason,
                                self.drafted_per_step, dict(self.decisions), self.cached_prompt_tokens,
                                {batch: (statistics.median(cost for cost, _ in decided),
                                         statistics.median(expected for _, expected in decided))
                                 for batch, decided in sorted(self.prices.items())})


class SpeculativeEngine:
    def __init__(self, target: LeanModel, drafter: Drafter | None = None, stop_ids: Collection[int] | None = None,
                 rule: str | None = None, pricing: Pricing | None = None, schedule: BatchSchedule | None = None,
                 clock: StepClock | None = None, sharing: SharedRows | None = None) -> None:
        """`pricing`: the plan's predicted tokens per step and speedup per batch size (Plan.predicted_at), against
        which each request decides step by step whether to draft (decoder/gate.py); None: every step drafts.
        `schedule`: the plan's setting per batch size and context, which each request follows step by step.
        `clock`: the steps' measured costs, which price a drafted step once measured (decoder/gate.py); None: the
        plan's price alone. `sharing`: each step's rows shared by the requests' expected yields (decoder/sharing.py),
        in place of the schedule and the per-request decisions."""
        self.target = target
        self.sharing = sharing
        self.pricing = pricing
        self.clock = clock
        self.schedule = schedule
        self.drafter = drafter or NoDrafter()
        self.stop_ids = set(stop_ids or ())
        self.rule_name = rule
        self.masks = TreeMasks()
        self.cache: KVCache | None = None  # the current generation's (LeanModel.cache_for keeps it for the next)

    def rule_for(self, params: SamplingParams, drafter: Drafter | None = None) -> VerificationRule:
        return choose_rule(self.rule_name, params, (drafter or self.drafter).draws)

    def check_fits(self, prompt_length: int, max_new_tokens: int) -> int:
        """The cache length a generation needs; an error if the model's context cannot hold it."""
        if prompt_length < 1:
            raise UserError("the prompt is empty")
        needed = prompt_length + max_new_tokens + self.drafter.max_tree_size
        limit = self.target.shape.max_context
        if prompt_length + max_new_tokens > limit:
            raise UserError(f"the prompt ({prompt_length} tokens) plus {max_new_tokens} new tokens exceeds the "
                            f"model's context of {limit}")
        if needed > limit:
            raise UserError(f"a tree of {self.drafter.max_tree_size} nodes does not fit the cache after "
                            f"{prompt_length + max_new_tokens} tokens (context {limit})")
        return needed

    @torch.inference_mode()
    def prepare(self, prompt_length: int, max_new_tokens: int, drafter: Drafter | None = None,
                role: str = "target", keep: bool = False) -> KVCache:
        """The empty target cache a generation of this size runs on, with the CUDA graphs of the drafter's tree
        sizes captured over it (on a GPU) and the drafter's own prepared, so that decoding replays graphs from
        its first step. A server (or a benchmark's warm-up) calls it ahead for the sizes it expects; `generate`
        calls it too. `drafter`, `role`: a batch's sequence, its own drafter and cache (decoder/batching.py);
        `keep`: the role's cache as its last sequence left it, where it is large enough (LeanModel.cache_for)."""
        drafter = drafter or self.drafter
        cache = self.target.cache_for(self.check_fits(prompt_length, max_new_tokens), role, keep=keep)
        if self.target.graphed is not None:
            self.target.graphed.capture(cache, drafter.target_tree_sizes())
        drafter.prepare(cache.max_len)
        return cache

    def start(self, prompt: list[int], max_new_tokens: int, params: SamplingParams, seed: int | None,
              on_tokens: Callable[[list[int]], None] | None = None, drafter: Drafter | None = None,
              role: str = "target", prefill: bool = True, keep_prefix: bool = False,
              ignore_eos: bool = False) -> SequenceRun:
        """A sequence prefilled and ready to step (see `prepare` for `drafter` and `role`); without `prefill`, its
        cache prepared and empty but for a kept prefix (a batch prefills several together, then calls
        SequenceRun.prefill). `keep_prefix`: the prefix the prompt shares with what the role's cache holds from its
        last sequence (a server's slot) is kept instead of computed again (KVCache.keep_prefix). `ignore_eos`: it
        stops at `max_new_tokens` only."""
        drafter = drafter or self.drafter
        start = time.perf_counter()
        cache = self.prepare(len(prompt), max_new_tokens, drafter, role, keep=keep_prefix)
        if keep_prefix:
            cache.keep_prefix(prompt)
        stop_ids = set() if ignore_eos else self.stop_ids
        run = SequenceRun(self.target, drafter, cache, self.rule_for(params, drafter), params, seed, max_new_tokens,
                          stop_ids, self.masks, on_tokens, self.pricing, self.schedule, self.clock,
                          self.sharing if drafter.shadows else None)
        if prefill:
            run.prefill(prompt)
            run.prefill_seconds = run.started - start
        return run

    def decide(self, runs: list[SequenceRun], load: int | None = None) -> None:
        """How much each of `runs`, the sequences of the coming step, drafts: the step's rows shared by their expected
        yields; else each its own decision (SequenceRun.decide; `load`: the most sequences of the engine's recent
        steps), made one kind of step where they differ."""
        if self.sharing is not None and all(run.sharing is not None for run in runs):
            for run, rows in zip(runs, self.sharing.decide([run.drafter for run in runs], [run.root for run in runs])):
                run.decisions[f"shared: {'drafts' if rows > 1 else 'plain'}"] += 1
            return
        for run in runs:
            run.decide(len(runs), load)
        gated = [run for run in runs if run.gate is not None]
        if len(gated) > 1:
            settle_step([run.gate for run in gated])
            for run in gated:
                run.drafter.drafting = run.gate.drafting

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, params: SamplingParams, seed: int | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        run = self.start(prompt, max_new_tokens, params, seed, on_tokens)
        self.cache = run.cache
        for step in itertools.count():
            start = time.perf_counter()
            if self.clock is not None:
                self.clock.begin_step()
            self.decide([run])
            item = run.propose()
            reading = run.drafter.reading_seconds
            passes = draft_passes([run], time.perf_counter() - start - reading)
            finished = run.advance(self.target.forward(*item))
            drafted, past_join = run.tree.size > 1, step >= UNTIMED_AFTER_JOIN
            if self.clock is not None and past_join and not (drafted and run.drafter.started_now):
                self.clock.step_done(1, drafted, time.perf_counter() - start - reading, passes)
            if self.sharing is not None and past_join:
                self.sharing.timed(time.perf_counter() - start)
            if finished:
                return run.result()


def draft_passes(runs: list[SequenceRun], seconds: float) -> DraftPasses | None:
    """The draft forwards of `runs`' trees just proposed, in `seconds` of proposing, where their drafters' number
    follows the text (Drafter.draft_passes); None where none does."""
    passes = [run.drafter.draft_passes for run in runs
              if run.tree is not None and run.tree.size > 1 and run.drafter.draft_passes is not None]
    return DraftPasses(seconds, sum(passes), len(passes)) if passes else None
