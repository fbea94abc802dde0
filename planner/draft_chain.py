"""The chain engines' own knobs, replayed: llama-server's `--spec-draft-n-max/-n-min/-p-min` (before build 11434:
`--draft-max/--draft-min/--draft-p-min`) and transformers' `num_assistant_tokens` with its schedule, searched over
the acceptance file's chain traces (T = 0) and priced on a profile.

Each engine's drafting rule, as its source has it (planner/engines.py cites both files):
- llama-server (common/speculative.cpp, draft-simple, build 11434): draft up to n-max tokens, each the draft
  sampler's top candidate; a candidate whose probability (over the sampler's top 10) is below p-min is not drafted
  and ends the draft. The draft decodes the last accepted token and each drafted token but the last: as many draft
  decodes as drafted tokens, one more where p-min ended the draft (the refused candidate's). A draft shorter than
  n-min is dropped: the target then scores one token, the draft's decodes spent. After every target forward the
  draft re-decodes the rows the target verified (common_speculative_process), and nothing else catches it up.
- transformers (generation/candidate_generator.py, AssistedCandidateGenerator): the assistant generates
  num_assistant_tokens tokens; the "heuristic" schedule then adds 2 when every drafted token was accepted, else
  takes 1 away (at least 1), kept across generate calls. assistant_confidence_threshold is left at 0: above 0,
  with scikit-learn installed, transformers re-tunes it every step from an ROC curve, which no fixed plan runs.

The replay walks each prompt's continuation: a step at position p drafts k tokens (the rules above over the
recorded confidences), the target accepts the leading matches and adds its own token, and the step costs
t(k + 1) + o(k + 1) (the profile's forward and engine overhead) plus the draft's work: for llama-server the
profile's measured draft work of a step with that many decodes (`plan profile --engine llama-server --draft`), else
one draft step per decode and, for llama-server, one more for its re-decoding of the verified rows; and each prompt
the draft's prefill of it (where the profile timed the draft's prefill and the trace records the prompt's length:
one-token decoding does not pay it, and it lands inside the decode time). At T = 0 the tokens each step yields
are exactly the engines' (a chain is accepted up to its first miss, and the traces are the draft teacher-forced on
the target's own tokens, which a chain's accepted prefix is); how far a chain runs past its first miss is priced
with the teacher-forced confidences there, an estimate. One-token decoding costs t(1) + o(1) a token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace

import numpy as np

from specplan.core.acceptance_schema import DraftChainTrace
from specplan.core.choices import MIN_SPEEDUP
from specplan.core.errors import UserError
from specplan.core.plan_schema import BatchSchedule
from specplan.core.profile_schema import LatencyProfile
from specplan.decoder.draft_rules import HEURISTIC_GROWTH, HEURISTIC_SHRINK
from specplan.planner.closed_loop import SettingPrice, mean_ragged_step, schedule_table

CHAIN_KNOB_ENGINES = ("llama.cpp", "hf")
P_MIN_GRID = tuple(round(0.05 * i, 2) for i in range(20))  # llama-server's --spec-draft-p-min: 0, 0.05, ..., 0.95
DRAFT_MIN_GRID = (0, 1, 2, 3)  # llama-server's --spec-draft-n-min
HF_SCHEDULES = ("constant", "heuristic")


@dataclass(frozen=True)
class ChainKnobs:
    """One engine setting and what its replay predicts."""

    engine: str
    draft_max: int  # llama-server's --spec-draft-n-max; transformers' (initial) num_assistant_tokens
    draft_min: int = 0  # llama.cpp
    p_min: float = 0.0  # llama.cpp
    schedule: str = "constant"  # transformers
    tokens_per_step: float = 0.0
    drafted_per_step: float = 0.0
    step_seconds: float = 0.0
    speedup: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def replay(chains: list[DraftChainTrace], knobs: ChainKnobs, draft_seconds: Callable[[int], float],
           forward_seconds: np.ndarray, prefill_seconds: Callable[[int], float | None] = lambda tokens: None
           ) -> ChainKnobs:
    """`knobs` with its prediction: `draft_seconds(decodes)`: the draft's work in a step that made that many draft
    decodes; `forward_seconds[n]` = t(n) + o(n) for n = 1..draft_max + 1; `prefill_seconds(prompt tokens)`: the
    draft's prefill of a prompt, None where unpriced."""
    tokens = steps = drafted_total = seconds = ar_seconds = 0.0
    for chain, walked in _walk(chains, knobs, len(forward_seconds) - 2):
        if chain.prompt_tokens is not None:
            seconds += prefill_seconds(chain.prompt_tokens) or 0.0
        for step_tokens, drafted, decodes, verified in walked:
            seconds += draft_seconds(decodes) + forward_seconds[verified]
            drafted_total += drafted
            tokens += step_tokens
            steps += 1
        ar_seconds += len(chain.match) * forward_seconds[1]
    if tokens == 0:
        raise UserError("the acceptance file's chain traces are empty")
    return ChainKnobs(knobs.engine, knobs.draft_max, knobs.draft_min, knobs.p_min, knobs.schedule,
                      float(tokens / steps), float(drafted_total / steps), float(seconds / steps),
                      float(ar_seconds / seconds))


def replayed_steps(chains: list[DraftChainTrace], knobs: ChainKnobs) -> tuple[float, np.ndarray]:
    """`knobs`' tokens per step over `chains` and its steps ([steps, 2]: the target's rows and the draft's decodes of
    each), the steps a batch of llama-server's slots mixes (planner/closed_loop.py: mean_ragged_step)."""
    walked = [step for _, steps in _walk(chains, knobs, knobs.draft_max) for step in steps]
    if not walked:
        raise UserError("the acceptance file's chain traces are empty")
    table = np.array(walked, dtype=np.int64)
    return float(table[:, 0].mean()), table[:, [3, 2]]


def _walk(chains: list[DraftChainTrace], knobs: ChainKnobs, largest_draft: int
          ) -> Iterator[tuple[DraftChainTrace, list[tuple[int, int, int, int]]]]:
    """Each chain with its steps under `knobs`' rule, each (tokens emitted, tokens drafted, draft decodes, the
    target's rows), drafting at most `largest_draft` tokens (the heuristic schedule's growth stops there)."""
    k = knobs.draft_max
    for chain in chains:
        length = len(chain.match)
        if knobs.schedule == "constant":
            k = knobs.draft_max
        position, steps = 0, []
        while position < length:
            room = min(k, length - position - 1)
            drafted = _drafted(chain, position, room, knobs.p_min)
            decodes = drafted + 1 if drafted < room else drafted  # p-min refused a candidate it decoded for
            if drafted < knobs.draft_min:
                accepted, verified = 0, 1
            else:
                accepted = _leading_matches(chain, position, drafted)
                verified = drafted + 1
            step_tokens = min(accepted + 1, length - position)
            steps.append((step_tokens, drafted, decodes, verified))
            position += step_tokens
            if knobs.schedule == "heuristic":
                k = min(k + HEURISTIC_GROWTH, largest_draft) if accepted == drafted else max(1, k - HEURISTIC_SHRINK)
        yield chain, steps


def _drafted(chain: DraftChainTrace, position: int, room: int, p_min: float) -> int:
    """Tokens drafted from `position`, up to `room` (at most one fewer than the tokens left: the target adds its own,
    as transformers caps it and llama-server given a token limit), stopping before the first whose confidence is
    below p_min (llama-server's rule; transformers' plans keep its threshold at 0)."""
    if p_min > 0:
        below = np.nonzero(chain.confidence[position:position + room] < p_min)[0]
        if len(below):
            return int(below[0])
    return room


def _leading_matches(chain: DraftChainTrace, position: int, drafted: int) -> int:
    misses = np.nonzero(~chain.match[position:position + drafted])[0]
    return int(misses[0]) if len(misses) else drafted


def best_knobs(engine: str, chains: list[DraftChainTrace], profile: LatencyProfile, max_depth: int,
               context: int | None = None) -> list[ChainKnobs]:
    """Every setting of `engine`'s knobs up to max_depth drafted tokens, replayed and ranked by predicted speedup
    (ties towards fewer drafted tokens, then the smaller knobs), each distinct outcome once."""
    if engine not in CHAIN_KNOB_ENGINES:
        raise UserError(f"{engine} has no chain knobs to replay (choose from {', '.join(CHAIN_KNOB_ENGINES)})")
    draft_seconds = draft_work(engine, profile, context)
    curve = profile.target_curve(context)
    largest = min(max_depth, curve.max_n - 1)
    if largest < 1:
        raise UserError(f"the profile covers t(n) up to n = {curve.max_n}: no chain of one token or more fits")
    sizes = np.arange(1, curve.max_n + 1)
    forward_seconds = np.zeros(curve.max_n + 1)
    forward_seconds[1:] = profile.step_seconds(sizes, context)
    if engine == "llama.cpp":
        settings = [ChainKnobs(engine, k, draft_min, p_min) for k in range(1, largest + 1)
                    for draft_min in DRAFT_MIN_GRID if draft_min <= k for p_min in P_MIN_GRID]
    else:
        settings = [ChainKnobs(engine, k, schedule=schedule)
                    for k in range(1, largest + 1) for schedule in HF_SCHEDULES]
    ranked = sorted((replay(chains, knobs, draft_seconds, forward_seconds, profile.draft_prefill)
                     for knobs in settings),
                    key=lambda c: (-c.speedup, c.drafted_per_step, c.draft_max, c.draft_min, c.p_min))
    distinct, seen = [], set()
    for knobs in ranked:  # settings that draft alike everywhere (a p_min no confidence falls below) listed once
        outcome = (round(knobs.tokens_per_step, 12), round(knobs.step_seconds, 15))
        if outcome not in seen:
            seen.add(outcome)
            distinct.append(knobs)
    return distinct


def draft_work(engine: str, profile: LatencyProfile, context: int | None) -> Callable[[int], float]:
    """The draft's seconds in a step of one sequence by its draft decodes: llama-server's measured work where the
    profile timed it, else one draft step per decode (and for llama-server one more: its re-decoding of the rows
    the target verified)."""
    if profile.draft_chains:
        return lambda decodes: profile.draft_chain_seconds(1, decodes, context)
    step = profile.draft_step(context)
    if step is None:
        raise UserError("the profile has no draft.step_seconds: a draft model's chain needs its per-step cost")
    extra = 1 if engine == "llama.cpp" else 0
    return lambda decodes: (decodes + extra) * step


def chain_setting_prices(chains: list[DraftChainTrace], decoding_lengths: set[int]) -> dict[int, SettingPrice]:
    """Each decoding length d of a draft model's chain (K = d - 1 drafted tokens): its exact T = 0 tokens per step
    over the chain traces, d rows for the target, K batched draft forwards, and the draft's prefill of each prompt."""
    unit = np.ones(max(decoding_lengths, default=1) + 1)  # replay's prices, unused by a fixed K's tokens/step
    return {d: SettingPrice(replay(chains, ChainKnobs("chain", d - 1), lambda decodes: 0.0, unit).tokens_per_step,
                            rows=d, draft_levels=d - 1, draft_model=True)
            for d in sorted(decoding_lengths) if d >= 2}


def chain_schedule(chains: list[DraftChainTrace], profile: LatencyProfile, largest_batch: int, max_depth: int,
                   context: int | None = None, prefill_per_token: float = 0.0, min_speedup: float = MIN_SPEEDUP,
                   knobs: ChainKnobs | None = None) -> tuple[BatchSchedule, dict[str, list[float | None]]]:
    """The draft length per batch size of a draft model's chain, the table vLLM (num_speculative_tokens_per_batch_size)
    and TensorRT-LLM (draft_len_schedule) take: at each B, every K = 0..max_depth priced on the profile's batched
    step t(B, K + 1) + o(K + 1, B) plus K batched draft steps, its tokens per step the exact T = 0 replay of a fixed
    K over the chain traces; the K with the most output tokens/s over the batch if at least `min_speedup` times K = 0's
    (else 0: off), ranges of equal K merged.
    With llama-server's `knobs` (its n-min and p-min; the draft length each K), each K is replayed under them and a
    step priced as the replayed steps' mix of rows and draft decodes over the batch's slots (`mean_ragged_step`): a
    p-min ends drafts early and an n-min drops short ones, so llama-server's slots draft unequal lengths.
    Also every K's predicted tokens/s per batch size 1, 2, ... ({"off": [...], "K=2": [...]}; None: not priced).
    `prefill_per_token`: the draft's prompt prefill spread over the tokens a sequence emits (the Sequoia solver's
    prompt_prefill_per_token), paid by each drafting sequence.
    Priced at `context`, else the traces' mean context (prompt and half the continuation); up to the largest batch
    size profiled, and on a modeled device up to the largest whose KV caches fit its memory."""
    if not profile.target_batches:
        raise UserError("a schedule per batch size needs a profile with --batches (t(B, n))")
    if context is None:
        spans = [chain.prompt_tokens + len(chain.match) / 2 for chain in chains if chain.prompt_tokens is not None]
        context = int(round(float(np.mean(spans)))) if spans else min(profile.target_batches)
    largest = min(largest_batch, max(profile.batch_sizes), profile.largest_fitting_batch(context) or largest_batch)
    lengths = set(range(2, max_depth + 2))
    if knobs is None:
        prices = {d: replace(price, host_seconds=price.tokens_per_step * prefill_per_token)
                  for d, price in chain_setting_prices(chains, lengths).items()}
        return schedule_table(prices, profile, largest, context, "sequoia", min_speedup)
    steps, prices = {}, {}
    for d in sorted(lengths):
        k = d - 1
        per_step, steps[d] = replayed_steps(chains, replace(knobs, draft_max=k, draft_min=min(knobs.draft_min, k)))
        prices[d] = SettingPrice(per_step, rows=d, draft_levels=k, draft_model=True,
                                 host_seconds=per_step * prefill_per_token)
    rng = np.random.default_rng(0)

    def mean_step(batch: int, length: int, price: SettingPrice) -> float:
        return mean_ragged_step(profile, steps[length], batch, price, context, rng)

    return schedule_table(prices, profile, largest, context, "sequoia", min_speedup, mean_step)
