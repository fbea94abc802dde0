"""The settings a plan gives its method's decoder: `TrieSettings` (Lookahead, and TriForce's trie bottom),
`TriForceSettings`, and a serving engine's `PromptLookupSettings` (SGLang's n-gram trie: `NgramTreeSettings`). A plan
file holds them as its `lookahead:`,
`triforce:` or `prompt-lookup:` section (core/plan_schema.py); the planner writes them, the decoder (or the bench,
for an engine's lookup) reads them, both by attribute."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from specplan.core.errors import UserError
from specplan.core.fileio import plain
from specplan.core.validate import Fields

MAX_PREFIX = 4  # longest context suffix matched
PROMPT_WEIGHT = 4.0  # prompt branches weigh this many output windows
CAPACITY_FACTOR = 16  # the trie holds this many L_d-token windows before pruning
# StreamingLLM's cache, as TriForce's bottom level keeps it: a few attention-sink tokens and a recent window.
STREAMING_SINKS = 4
STREAMING_WINDOW = 1024
TRIFORCE_BOTTOMS = ("trie", "model", "none", "streaming")
MAX_GAMMA = 64  # draft tokens per level and round; TriForce's published settings use at most 16


@dataclass(frozen=True)
class TrieSettings:
    """Lookahead's trie (decoder/trie.py): how drafts are retrieved and how much the trie holds."""

    decoding_length: int = 16  # L_d: tokens the target scores per step, root included
    branch_length: int = 8  # L_b: deepest draft token below the root
    window: int = MAX_PREFIX + 8  # tokens per inserted branch (a matched context plus its continuation)
    max_prefix: int = MAX_PREFIX
    capacity: int = CAPACITY_FACTOR * 16 * (MAX_PREFIX + 8)  # nodes before pruning
    prompt_weight: float = PROMPT_WEIGHT

    @classmethod
    def sized(cls, decoding_length: int, branch_length: int) -> TrieSettings:
        """Lookahead's settings for L_d and L_b: windows hold a matched context and a full branch, and the
        capacity is CAPACITY_FACTOR x L_d windows (the defaults above are those of L_d 16, L_b 8)."""
        window = MAX_PREFIX + branch_length
        return cls(decoding_length, branch_length, window, MAX_PREFIX, CAPACITY_FACTOR * decoding_length * window,
                   PROMPT_WEIGHT).check()

    def check(self) -> TrieSettings:
        if self.decoding_length < 1:
            raise UserError(f"decoding length L_d must be >= 1, got {self.decoding_length}")
        if self.branch_length < 1:
            raise UserError(f"branch length L_b must be >= 1, got {self.branch_length}")
        if self.max_prefix < 1 or self.window < 2 or self.capacity < 1 or self.prompt_weight < 0:
            raise UserError("trie settings: max_prefix >= 1, window >= 2, capacity >= 1, prompt_weight >= 0")
        return self

    @classmethod
    def from_fields(cls, f: Fields) -> TrieSettings:
        integers = {key: f.token_count(key) for key in ("decoding_length", "branch_length", "window", "max_prefix",
                                                         "capacity")}
        settings = cls(**integers, prompt_weight=f.number("prompt_weight", low=0.0, high=1e6))
        if settings.window < 2 or settings.max_prefix >= settings.window:
            raise f.fail("the window must be >= 2 and longer than max_prefix")
        return settings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RetrievalSettings:
    """TriForce's retrieval cache (decoder/triforce.py: RetrievalCache): the target's KV cache reduced to `budget`
    tokens in chunks of `chunk`, rebuilt every `stride` inserted tokens or when the rolling acceptance falls below
    `rebuild_below`."""

    budget: int = 1024
    chunk: int = 8
    stride: int = 128  # rebuild after this many inserted tokens
    rebuild_below: float = 0.0  # rebuild when the rolling top-level acceptance falls below this (0: never)

    def check(self, context: int | None = None) -> RetrievalSettings:
        if self.chunk < 1 or self.budget < 2 * self.chunk:
            raise UserError(f"the budget ({self.budget}) must hold at least two chunks of {self.chunk}")
        if self.budget % self.chunk:
            raise UserError(f"the chunk size {self.chunk} does not divide the budget {self.budget}")
        if context is not None and self.budget >= context:
            raise UserError(f"the budget {self.budget} is not below the context ({context} tokens)")
        if self.stride < 1:
            raise UserError("the rebuild stride must be >= 1")
        return self


def check_gammas(gamma1: int, gamma2: int) -> None:
    """TriForce's draft lengths: gamma1 tokens per middle round from the bottom, gamma2 per chain to the top."""
    if not 1 <= gamma1 <= gamma2 <= MAX_GAMMA:
        raise UserError(f"need 1 <= gamma1 <= gamma2 <= {MAX_GAMMA}, got gamma1 = {gamma1}, gamma2 = {gamma2}")


@dataclass(frozen=True)
class TriForceSettings:
    """A TriForce plan's decoding: the bottom level (`trie`, `model`: the draft over a StreamingLLM cache of
    `sinks` + `window` tokens, `none`: the two-level variant, `streaming`: no middle level) drafting gamma1 tokens
    per middle round, the middle level (the target over a retrieval cache of `budget` tokens in chunks of
    `chunk`, rebuilt every `stride` tokens, or when the rolling acceptance falls below `rebuild_below`) drafting
    gamma2 tokens for the full target, planned for prompts of `context` tokens. `speculate: false` decodes one
    token per step (the others are then the best speculative setting's, which `plan bench` runs as baselines)."""

    gamma1: int
    gamma2: int
    budget: int
    chunk: int
    stride: int
    context: int
    bottom: str  # one of TRIFORCE_BOTTOMS
    rebuild_below: float = 0.0
    sinks: int = STREAMING_SINKS
    window: int = STREAMING_WINDOW
    speculate: bool = True

    @classmethod
    def from_fields(cls, f: Fields) -> TriForceSettings:
        settings = cls(f.integer("gamma1"), f.integer("gamma2"), f.token_count("budget"), f.token_count("chunk"),
                       f.token_count("stride"), f.token_count("context"), f.string("bottom", choices=TRIFORCE_BOTTOMS),
                       f.number("rebuild_below", low=0.0, high=1.0), f.token_count("sinks", low=0),
                       f.token_count("window"), f.boolean("speculate", default=True))
        try:
            check_gammas(settings.gamma1, settings.gamma2)
            settings.retrieval().check()
        except UserError as exc:
            raise f.fail(str(exc)) from None
        return settings

    def retrieval(self) -> RetrievalSettings:
        return RetrievalSettings(self.budget, self.chunk, self.stride, self.rebuild_below)

    def check(self) -> TriForceSettings:
        """The loader's checks, for settings made in code (the solver's, before it writes them)."""
        return TriForceSettings.from_fields(Fields(plain(self.to_dict()), "triforce settings"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)



MAX_LOOKUP_NGRAM = 16
MAX_LOOKUP_DRAFT = 64


@dataclass(frozen=True)
class PromptLookupSettings:
    """An engine's prompt lookup (planner/prompt_lookup.py): the longest trailing n-gram it looks up, and the tokens
    it drafts after a match (transformers: max_matching_ngram_size, prompt_lookup_num_tokens; llama-cpp-python:
    max_ngram_size, num_pred_tokens)."""

    max_ngram: int = 2
    num_tokens: int = 10
    enabled: bool = True  # False: no setting beat one-token decoding, so the engine runs without prompt lookup
    min_ngram: int = 1  # vLLM's prompt_lookup_min: shorter n-grams are not looked up

    @property
    def max_draft_tokens(self) -> int:
        return self.num_tokens

    @classmethod
    def from_fields(cls, f: Fields) -> PromptLookupSettings:
        settings = cls(f.integer("max_ngram", low=1, high=MAX_LOOKUP_NGRAM),
                       f.integer("num_tokens", low=1, high=MAX_LOOKUP_DRAFT), f.boolean("enabled", default=True),
                       f.integer("min_ngram", required=False, default=1, low=1, high=MAX_LOOKUP_NGRAM))
        if settings.min_ngram > settings.max_ngram:
            raise f.fail("min_ngram must not exceed max_ngram")
        return settings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# SGLang's NGRAM limits and defaults (python/sglang/srt/arg_groups/fields/spec.py, speculative_hook.py, v0.5.23)
SGLANG_TRIE_DEPTH = 18  # --speculative-ngram-max-trie-depth: the longest n-gram inserted and matched
SGLANG_MAX_BFS_BREADTH = 10  # --speculative-ngram-max-bfs-breadth (the breadth below the shortest match)
SGLANG_DRAFT_TOKENS = 12  # --speculative-num-draft-tokens when not given: the tokens verified per step, root included
MAX_SGLANG_DRAFT_TOKENS = 128  # a planning bound (SGLang's tree kernels take up to 1024)
MAX_SGLANG_TRIE_DEPTH = 64  # a planning bound
SGLANG_MATCH_TYPES = ("BFS", "PROB")  # --speculative-ngram-match-type: children by recency, or by frequency


@dataclass(frozen=True)
class NgramTreeSettings:
    """SGLang's NGRAM speculative decoding (planner/sglang_ngram.py): a trie of the n-grams of every request so far,
    up to `max_trie_depth` tokens deep, from which each step grows a token tree breadth-first (between
    `min_bfs_breadth` and `max_bfs_breadth` children per node); the target verifies `num_draft_tokens` tokens
    every step, the last token and the tree padded to that size. `match_type` BFS (SGLang's default) walks the most
    recent children breadth-first; PROB takes the most probable continuations by their counts, at most
    `max_bfs_breadth` children a node."""

    num_draft_tokens: int = SGLANG_DRAFT_TOKENS
    max_trie_depth: int = SGLANG_TRIE_DEPTH
    max_bfs_breadth: int = SGLANG_MAX_BFS_BREADTH
    min_bfs_breadth: int = 1
    match_type: str = "BFS"  # one of SGLANG_MATCH_TYPES
    enabled: bool = True  # False: no setting beat one-token decoding, so the engine runs without NGRAM

    @property
    def max_draft_tokens(self) -> int:
        return self.num_draft_tokens - 1

    @classmethod
    def from_fields(cls, f: Fields) -> NgramTreeSettings:
        settings = cls(f.integer("num_draft_tokens", low=2, high=MAX_SGLANG_DRAFT_TOKENS),
                       f.integer("max_trie_depth", low=2, high=MAX_SGLANG_TRIE_DEPTH),
                       f.integer("max_bfs_breadth", low=1, high=MAX_SGLANG_DRAFT_TOKENS),
                       f.integer("min_bfs_breadth", required=False, default=1, low=1, high=MAX_SGLANG_DRAFT_TOKENS),
                       match_type=f.string("match_type", required=False, default="BFS", choices=SGLANG_MATCH_TYPES),
                       enabled=f.boolean("enabled", default=True))
        if settings.min_bfs_breadth > settings.max_bfs_breadth:  # SGLang's own check (ngram.cpp: Ngram::Ngram)
            raise f.fail("min_bfs_breadth must not exceed max_bfs_breadth")
        return settings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
