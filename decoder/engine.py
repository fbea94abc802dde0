"""The verification engine: a drafter proposes a token tree, the target scores it in one forward over its static
KV cache, a verification rule walks it, and the cache keeps the accepted path. Autoregressive decoding is the
same loop with a one-node tree."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from specplan.core.errors import UserError
from specplan.decoder.drafters import Drafter, NoDrafter
from specplan.decoder.model import KVCache, LeanModel
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.tree import ancestor_matrix, tree_attention_mask
from specplan.decoder.verify import VerificationRule, choose_rule


@dataclass
class GenerationResult:
    tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    steps: int
    accepted_per_step: list[int] = field(default_factory=list)  # tokens emitted per target forward
    stop_reason: str = "length"

    @property
    def tokens_per_step(self) -> float:
        return len(self.tokens) / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0


class SpeculativeEngine:
    def __init__(self, target: LeanModel, drafter: Drafter | None = None, stop_ids: Collection[int] | None = None,
                 rule: str | None = None) -> None:
        self.target = target
        self.drafter = drafter or NoDrafter()
        self.stop_ids = set(stop_ids or ())
        self.rule_name = rule
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self.cache: KVCache | None = None  # the current generation's (LeanModel.cache_for keeps it for the next)

    def rule_for(self, params: SamplingParams) -> VerificationRule:
        return choose_rule(self.rule_name, params, self.drafter.draws)

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
    def prepare(self, prompt_length: int, max_new_tokens: int) -> KVCache:
        """The empty target cache a generation of this size runs on, with the CUDA graphs of the drafter's tree
        sizes captured over it (on a GPU) and the drafter's own prepared, so that decoding replays graphs from
        its first step. A server (or a benchmark's warm-up) calls it ahead for the sizes it expects; `generate`
        calls it too."""
        cache = self.target.cache_for(self.check_fits(prompt_length, max_new_tokens), "target")
        if self.target.graphed is not None:
            self.target.graphed.capture(cache, self.drafter.target_tree_sizes())
        self.drafter.prepare(cache.max_len)
        return cache

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, params: SamplingParams, seed: int | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        rule = self.rule_for(params)
        generator = torch.Generator(device=self.target.device).manual_seed(seed if seed is not None else 0)
        target = self.target
        start = time.perf_counter()
        cache = self.cache = self.prepare(len(prompt), max_new_tokens)
        max_len = cache.max_len
        target.prefill(torch.tensor(prompt[:-1], dtype=torch.long), cache, logits=False, prompt_length=len(prompt))
        prefill_seconds = time.perf_counter() - start

        start = time.perf_counter()
        # The drafter's own prefill (a draft model's prompt, a StreamingLLM window) is a cost of speculating,
        # which one-token decoding does not pay: it counts as decoding time.
        self.drafter.reset(prompt, max_len)
        self.drafter.bind(cache)
        out: list[int] = []
        accepted_per_step: list[int] = []
        root = prompt[-1]
        reason = "length"
        while len(out) < max_new_tokens:
            tree = self.drafter.propose(root, params, rule.draw, generator)
            tokens = torch.tensor(tree.tokens)
            positions = cache.length + torch.tensor(tree.depths)
            mask = self._mask(tree.parents, cache.length) if tree.size > 1 else None
            logits = target.forward(tokens, positions, cache, mask)
            path, next_token = rule.walk(tree, logits, params, generator)
            contiguous = path == list(range(len(path)))
            cache.commit(None if contiguous else torch.tensor(path), len(path))
            new = [tree.tokens[v] for v in path[1:]] + [next_token]
            accepted_per_step.append(len(new))
            keep = min(max_new_tokens - len(out), next((i + 1 for i, t in enumerate(new) if t in self.stop_ids),
                                                       len(new)))
            if any(t in self.stop_ids for t in new[:keep]):
                reason = "stop"
            # The drafter learns exactly the emitted tokens (a trie must not see tokens past the end).
            if keep < len(new):
                self.drafter.update(tree, path[:keep + 1], None)
            else:
                self.drafter.update(tree, path, next_token)
            out.extend(new[:keep])
            if on_tokens is not None:
                on_tokens(new[:keep])
            if reason == "stop" or len(out) >= max_new_tokens:
                break
            root = next_token
        return GenerationResult(out, prefill_seconds, time.perf_counter() - start, len(accepted_per_step),
                                accepted_per_step, reason)

    def _mask(self, parents: list[int], prefix: int) -> torch.Tensor:
        key = tuple(parents)
        allowed = self._masks.get(key)
        if allowed is None:
            allowed = self._masks[key] = ancestor_matrix(parents)
            if len(self._masks) > 256:
                self._masks.clear()
        return tree_attention_mask(allowed, prefix, self.target.dtype)
