"""The drafting rules serving engines ship, run step by step in our decoder (`plan serve --rule NAME`): each decides
how many tokens a request drafts at the coming step from the batch size and what drafts have done so far, and,
for a draft model's chain, when drafting stops early. Each runs on the drafter its engine made it for: TensorRT-LLM's
AUTO rule on n-gram drafting (here a Lookahead trie), the others on a draft model's chain (a Sequoia chain plan).
A rule replaces the plan's schedule and the per-request drafting decisions; verification is unchanged, so every rule
is as lossless as the plan it runs on. `rule_maker` builds them by their names in core/choices.py (DRAFT_RULES).

Read from each engine's code (planner/engines.py keeps the sources with their commits):
- TensorRT-LLM AUTO (AutoDecodingConfig, PR #6232): n-gram drafting of 5 tokens up to 4 requests in flight, 3 up to
  32, none beyond.
- transformers (generation/candidate_generator.py, stopping_criteria.py ConfidenceCriteria; defaults in
  configuration_utils.py): the assistant drafts num_assistant_tokens (20) tokens; the "heuristic" schedule adds 2
  after a draft accepted whole, else takes 1 away (at least 1); the assistant stops after a token whose probability
  is below assistant_confidence_threshold (0.4). With scikit-learn installed transformers re-tunes that threshold
  from an ROC curve every step; without it (as here) the threshold stays.
- llama.cpp's llama-server (common/common.h, common_params_speculative_draft; common/speculative.cpp, draft-simple):
  up to n_max (3) tokens, each the draft sampler's top candidate, stopping before one whose probability over the
  sampler's top 10 is below p_min (0: never; that token is not drafted); a draft shorter than n_min (0) is dropped.
- SGLang (speculative/adaptive_spec_params.py, adaptive_step_router.py): per batch-size tier (the largest key at or
  below the batch size; default tiers 1, 8, 32, 64 with candidate steps [1, 3, 5, 7], [0, 1, 3], [0, 1], [0]) an EMA
  (alpha 0.2) of the batch's mean accepted drafts; after 10 warm-up steps, every 5 steps the tier's steps move to the
  candidate the EMA says (down while the EMA is at most the next lower candidate - 0.5 plus its hysteresis, else up
  while above the current one - 0.5); 0 steps: no drafting, the next decision probes the next candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specplan.core.acceptance_schema import DRAFT_SAMPLER_TOP_K
from specplan.core.choices import DRAFT_RULES
from specplan.core.errors import UserError

TRTLLM_AUTO_TIERS = ((4, 5), (32, 3))  # (most requests in flight, draft tokens); beyond the last: none
HF_DEFAULT_TOKENS, HF_DEFAULT_THRESHOLD = 20, 0.4
HEURISTIC_GROWTH, HEURISTIC_SHRINK = 2, 1  # transformers' heuristic schedule: +2 on a fully accepted draft, else -1
LLAMACPP_DEFAULT_MAX, LLAMACPP_DEFAULT_MIN, LLAMACPP_DEFAULT_P_MIN = 3, 0, 0.0
SGLANG_DEFAULT_TIERS = {1: (1, 3, 5, 7), 8: (0, 1, 3), 32: (0, 1), 64: (0,)}
SGLANG_DEFAULT_DOWN_HYSTERESIS = {1: -0.25}  # the other default tiers: 0
SGLANG_EMA_ALPHA, SGLANG_UPDATE_INTERVAL, SGLANG_WARMUP_STEPS = 0.2, 5, 10
RULE_CHAIN_TOKENS = 32  # the longest chain a rule drafts here (transformers' heuristic grows without a bound)


def draft_confidence(logits: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """The draft's probability of its top token per row of `logits` ([rows, vocab]): over its `top_k` candidates
    (llama.cpp's sampler), or over the whole vocabulary (None: transformers)."""
    scores = logits.float()
    if top_k is not None:
        scores = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values
    return scores.softmax(-1).max(-1).values


@dataclass
class ChainStop:
    """When a draft model's chain stops before its length: at a token whose confidence is below `below`, that
    confidence taken over the draft's `top_k` candidates (None: all), the token kept as the chain's last
    (`keeps_last`: transformers) or not drafted (llama-server); a chain of fewer than `min_tokens` drafted tokens is
    dropped (the target scores the root alone)."""

    below: float = 0.0
    top_k: int | None = None
    min_tokens: int = 0
    keeps_last: bool = True


NO_STOP = ChainStop()


class DraftRule:
    """One engine's rule: `tokens(batch)` before each step (draft tokens, 0: none), `observe` after it."""

    on_chain = True  # a draft model's chain; False: n-gram drafting (a Lookahead trie)
    stop = NO_STOP

    def tokens(self, batch: int) -> int:
        raise NotImplementedError

    def observe(self, drafted: int, accepted: int, batch: int) -> None:
        """A step of `batch` sequences verified this request's `drafted` tokens and accepted the first `accepted`."""


class TrtllmAuto(DraftRule):
    on_chain = False

    def tokens(self, batch: int) -> int:
        return next((k for most, k in TRTLLM_AUTO_TIERS if batch <= most), 0)


@dataclass
class HfAssisted(DraftRule):
    """transformers' assisted generation: per request (its slot's assistant), the heuristic schedule and the
    confidence threshold."""

    num_assistant_tokens: int = HF_DEFAULT_TOKENS
    heuristic: bool = True
    threshold: float = HF_DEFAULT_THRESHOLD

    def __post_init__(self) -> None:
        self.stop = ChainStop(self.threshold, None)

    def tokens(self, batch: int) -> int:
        return self.num_assistant_tokens

    def observe(self, drafted, accepted, batch):
        if self.heuristic and drafted > 0:
            self.num_assistant_tokens = (self.num_assistant_tokens + HEURISTIC_GROWTH if accepted == drafted
                                         else max(1, self.num_assistant_tokens - HEURISTIC_SHRINK))


@dataclass
class LlamaCppDraft(DraftRule):
    n_max: int = LLAMACPP_DEFAULT_MAX
    n_min: int = LLAMACPP_DEFAULT_MIN
    p_min: float = LLAMACPP_DEFAULT_P_MIN

    def __post_init__(self) -> None:
        self.stop = ChainStop(self.p_min, DRAFT_SAMPLER_TOP_K, self.n_min, keeps_last=False)

    def tokens(self, batch: int) -> int:
        return self.n_max


@dataclass
class _SglangTier:
    candidates: tuple[int, ...]
    down_hysteresis: float
    steps: int
    ema: float
    verified: int = 0

    def update(self, accepted: list[int]) -> None:
        if self.steps > 0:
            self.ema = (1 - SGLANG_EMA_ALPHA) * self.ema + SGLANG_EMA_ALPHA * sum(accepted) / len(accepted)
        self.verified += 1
        if self.verified > SGLANG_WARMUP_STEPS and (self.verified - SGLANG_WARMUP_STEPS) % SGLANG_UPDATE_INTERVAL == 0:
            self._move()

    def _move(self) -> None:
        index = self.candidates.index(self.steps)
        if self.steps == 0:  # probe the next candidate
            target = self.candidates[min(index + 1, len(self.candidates) - 1)]
            if target > 0 and self.ema < 0:
                self.ema = float(target - 1)
            self.steps = target
            return
        start = index
        while index > 0:
            lower = self.candidates[index - 1]
            if self.ema <= (0.5 if lower == 0 else lower - 0.5) + self.down_hysteresis:
                index -= 1
            else:
                break
        if index == start:
            while index < len(self.candidates) - 1 and self.ema > self.candidates[index] - 0.5:
                index += 1
        self.steps = self.candidates[index]


@dataclass
class SglangEma(DraftRule):
    """SGLang's adaptive steps: one controller for the whole server (every request shares it), a tier per batch-size
    key; each step's accepted drafts, over the batch, update the tier of the batch size they were verified at."""

    initial_steps: int = 3
    tiers: dict[int, _SglangTier] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)
    pending_batch: int = 1

    def __post_init__(self) -> None:
        for key, candidates in SGLANG_DEFAULT_TIERS.items():
            steps = self.initial_steps if self.initial_steps in candidates else candidates[len(candidates) // 2]
            self.tiers[key] = _SglangTier(candidates, SGLANG_DEFAULT_DOWN_HYSTERESIS.get(key, 0.0), steps,
                                          float(steps - 1))

    def _tier(self, batch: int) -> _SglangTier:
        return self.tiers[max([key for key in self.tiers if key <= batch] or [min(self.tiers)])]

    def tokens(self, batch: int) -> int:
        if self.pending:  # the last step's verifications, folded in once its batch is done
            self._tier(self.pending_batch).update(self.pending)
            self.pending = []
        return self._tier(batch).steps

    def observe(self, drafted, accepted, batch):
        self.pending.append(accepted)
        self.pending_batch = batch


def rule_maker(name: str) -> Callable[[], DraftRule]:
    """What makes `name`'s rule (core/choices.py: DRAFT_RULES) for each slot: its own, or SGLang's one controller
    for every slot."""
    if name == "sglang-ema":
        shared = SglangEma()
        return lambda: shared
    makers = {"trtllm-auto": TrtllmAuto, "hf-heuristic": HfAssisted,
              "hf-constant": lambda: HfAssisted(heuristic=False), "llama.cpp": LlamaCppDraft}
    if name not in makers:
        raise UserError(f"unknown drafting rule {name!r} (choose from {', '.join(DRAFT_RULES)})")
    return makers[name]
