"""TriForce: hierarchical speculation for long contexts.

- StreamingDrafter: a model with a StreamingLLM cache (attention sinks plus a window of recent tokens)
  drafts a chain of tokens. It is the bottom level of the hierarchy, or on its own the "StreamingLLM-only"
  drafter (the target itself with a streaming cache, for a target with no small sibling).
- RetrievalCache: the target's own KV cache reduced to a budget B: keys split into chunks of s tokens, each
  chunk scored per layer and KV head by (query . mean key of the chunk), the query summed over the query heads
  that share the KV head (GQA); the sink chunk and the unchunked tail are always kept, then the best chunks.
  Chunks are laid out best first, so the lowest-ranked slots are the last ones: accepted tokens overwrite
  them from the end. It is rebuilt from the latest query every `stride` tokens, when the slots run out, or
  when the rolling acceptance of the top level falls below `rebuild_below`.
- HierarchicalDrafter: the middle level is the target over the retrieval cache. The bottom drafter proposes
  gamma1 tokens, the middle level verifies them (a verification rule from decoder/verify.py: the residual
  norm(max(p_hat - q, 0)) on rejection), and rounds repeat until at least gamma2 tokens are collected. The
  chain goes to the engine with p_hat at each node, so the top level (the target with its full cache)
  verifies it like any draft: the output is exactly the target's.
"""

from __future__ import annotations

from collections import deque

import torch

from specplan.core.errors import UserError
from specplan.core.method_settings import (
    MAX_PREFIX,
    STREAMING_SINKS,
    STREAMING_WINDOW,
    RetrievalSettings,
    TrieSettings,
    check_gammas,
)
from specplan.decoder.drafters import Drafter, choose_children
from specplan.decoder.model import KVCache, LeanModel, causal_mask
from specplan.decoder.sampling import probabilities
from specplan.decoder.tree import DETERMINISTIC, WITHOUT_REPLACEMENT, DraftTree, ancestor_matrix, tree_attention_mask
from specplan.decoder.verify import choose_rule


def bottom_trie_settings(gamma1: int) -> TrieSettings:
    """A trie bottom's drafts: at most gamma1 tokens below the root, as the planner's model assumes."""
    return TrieSettings(decoding_length=gamma1 + 1, branch_length=gamma1, window=MAX_PREFIX + gamma1)


def chain_tree(tokens: list[int], draw: str = DETERMINISTIC) -> DraftTree:
    return DraftTree(tokens, [-1] + list(range(len(tokens) - 1)), draw)


class StreamingDrafter(Drafter):
    """Drafts `gamma` tokens one forward at a time over a StreamingLLM cache (sinks + recent window)."""

    draws = (DETERMINISTIC, WITHOUT_REPLACEMENT)

    def __init__(self, model: LeanModel, gamma: int, sinks: int = STREAMING_SINKS,
                 window: int = STREAMING_WINDOW) -> None:
        if gamma < 1 or sinks < 0 or window < 1:
            raise UserError("streaming drafter: gamma >= 1, sinks >= 0, window >= 1")
        self.model, self.gamma, self.sinks, self.window = model, gamma, sinks, window
        self.max_tree_size = gamma + 1
        self.cache: KVCache | None = None
        self.pending: list[int] = []  # committed tokens not yet in the cache
        self.positions = 0  # committed tokens so far (the true position of the next one)

    def reset(self, prompt, max_len):
        size = min(self.sinks + self.window + 4 * self.max_tree_size + 8, max_len)
        self.cache = self.model.cache_for(size, "streaming" + self.role_suffix,  # the window is what its size leaves
                                          exact=True)
        if self.model.has_windows and self.cache.key_positions is None:
            self.cache.track_positions()  # evictions leave slots that are not positions: sliding windows need them
        self.pending = list(prompt[:-1])
        self.positions = len(prompt) - 1
        self._flush_pending_into_window()

    def _flush_pending_into_window(self) -> None:
        """Prefill only what the window keeps: the sinks and the most recent tokens."""
        tokens, self.pending = self.pending, []
        start = self.positions - len(tokens)
        sink_part = [t for i, t in enumerate(tokens) if start + i < self.sinks]
        recent = tokens[len(sink_part):][-self.window:]
        for part, first in ((sink_part, start), (recent, self.positions - len(recent))):
            if part:
                self._forward_committed(part, first)

    def _forward_committed(self, tokens: list[int], first_position: int) -> None:
        self._make_room(len(tokens))
        n = len(tokens)
        mask = causal_mask(self.cache.length, n, self.model.dtype, self.model.device) if n > 1 else None
        self.model.forward(torch.tensor(tokens), torch.arange(first_position, first_position + n), self.cache, mask,
                           logits_rows=slice(0, 0))
        self.cache.commit(None, n)

    def _make_room(self, incoming: int) -> None:
        """Evict the oldest non-sink entries so that the window plus `incoming` scratch tokens fit."""
        cache = self.cache
        limit = cache.max_len - self.max_tree_size - incoming
        excess = cache.length - max(limit, self.sinks)
        if excess > 0:
            cache.move(slice(self.sinks + excess, cache.length), slice(self.sinks, cache.length - excess))
            cache.length -= excess

    @torch.inference_mode()
    def propose(self, root, params, draw, generator):
        chain = self.pending + [root]
        self.pending = []
        self._make_room(len(chain) + self.gamma)
        first = self.positions - (len(chain) - 1)
        mask = causal_mask(self.cache.length, len(chain), self.model.dtype, self.model.device) \
            if len(chain) > 1 else None
        logits = self.model.forward(torch.tensor(chain), torch.arange(first, first + len(chain)), self.cache, mask,
                                    logits_rows=slice(len(chain) - 1, None))
        self.cache.commit(None, len(chain) - 1)
        scratch = self.cache.length  # the root's slot; draft tokens follow it
        draw = DETERMINISTIC if params.greedy else draw
        tokens, probs = [root], {}
        for depth in range(self.gamma):
            picks, distribution = choose_children(logits.float(), [1], params, draw, generator)
            if distribution is not None:
                probs[depth] = distribution[0]
            tokens.append(picks[0][0])
            if depth < self.gamma - 1:
                self.cache.length = scratch + depth + 1
                logits = self.model.forward(torch.tensor([tokens[-1]]), torch.tensor([self.positions + depth + 1]),
                                            self.cache, None)
                self.cache.length = scratch
        tree = chain_tree(tokens, draw)
        tree.draft_probs = probs
        return tree

    def update(self, tree, accepted, next_token):
        # The root and the first gamma - 1 draft tokens were forwarded into slots after the prefix.
        forwarded = min(len(accepted), self.gamma)
        self.cache.commit(None, forwarded)
        self.pending = [tree.tokens[v] for v in accepted[forwarded:]]
        self.positions += len(accepted)

    def extend(self, tokens: list[int]) -> None:
        self.pending.extend(tokens)
        self.positions += len(tokens)

    def rollback(self, count: int) -> None:
        from_pending = min(count, len(self.pending))
        self.pending = self.pending[:len(self.pending) - from_pending]
        self.cache.length = max(self.cache.length - (count - from_pending), 0)
        self.positions -= count


class RetrievalCache:
    def __init__(self, model: LeanModel, settings: RetrievalSettings, scratch: int) -> None:
        self.model = model
        self.settings = settings
        self.scratch = scratch
        self.cache: KVCache | None = None
        self.next_slot = 0  # replacement pointer, moving down from the last slot
        self.inserted = 0
        self.builds = 0

    @torch.inference_mode()
    def build(self, full: KVCache, queries: torch.Tensor) -> None:
        shape, s, budget = self.model.shape, self.settings.chunk, self.settings.budget
        length = full.length
        chunks = length // s
        tail = length - chunks * s
        if chunks * s < budget:
            raise UserError(f"the budget {budget} is not below the context ({length} tokens)")
        if self.cache is None:
            self.cache = KVCache(shape, budget + s + self.scratch, full.k.dtype, full.k.device)
            if self.model.has_windows:
                self.cache.track_positions()  # the slots hold chosen chunks: their positions set the windows' masks
        group = shape.heads // shape.kv_heads
        means = full.k[:, :, :chunks * s].float().view(shape.layers, shape.kv_heads, chunks, s, -1).mean(3)
        q = queries.float().view(shape.layers, shape.kv_heads, group, -1).sum(2)
        scores = torch.einsum("lhd,lhcd->lhc", q, means)
        scores[:, :, 0] = float("inf")  # the attention sink
        for layer, window in enumerate(self.model.architecture.layer_windows):
            if window is not None:
                # A sliding-window layer spends its budget inside its window: a chunk whose every token lies W or
                # more positions before the next query would be masked out anyway.
                scores[layer, :, :max(0, (length - window + 1) // s)] = float("-inf")
        best = torch.topk(scores, budget // s, dim=-1).indices  # best first
        index = (best[..., None] * s + torch.arange(s, device=best.device)).flatten(2)
        tail_index = torch.arange(chunks * s, length, device=best.device).expand(*index.shape[:2], tail)
        index = torch.cat([index, tail_index], 2)
        kept = index.shape[2]
        # Row copies straight into each head's contiguous slots: at a 2048 budget over 7680 tokens, 12 ms
        # against 100 ms for a torch.gather along the slot axis (which reads an index per element).
        for source, target in ((full.k, self.cache.k), (full.v, self.cache.v)):
            for layer in range(shape.layers):
                for head in range(shape.kv_heads):
                    torch.index_select(source[layer, head], 0, index[layer, head], out=target[layer, head, :kept])
        if self.cache.key_positions is not None:
            self.cache.key_positions[:, :, :kept] = index
        self.cache.length = kept
        self.next_slot = budget - 1
        self.inserted = 0
        self.builds += 1

    def insert(self, full: KVCache, start: int, end: int) -> bool:
        """Copy the committed tokens start..end-1 over the lowest-ranked slots; False when a rebuild is due."""
        count = end - start
        if self.next_slot - count + 1 < self.settings.chunk or self.inserted + count > self.settings.stride:
            return False
        slots = torch.arange(self.next_slot, self.next_slot - count, -1, device=full.k.device)
        self.cache.k[:, :, slots] = full.k[:, :, start:end]
        self.cache.v[:, :, slots] = full.v[:, :, start:end]
        if self.cache.key_positions is not None:
            self.cache.key_positions[:, :, slots] = torch.arange(start, end, device=slots.device)
        self.next_slot -= count
        self.inserted += count
        return True


class HierarchicalDrafter(Drafter):
    """Bottom drafter -> target over a retrieval cache -> (the engine's) target over the full cache."""

    draws = (DETERMINISTIC, WITHOUT_REPLACEMENT)

    def __init__(self, target: LeanModel, bottom: Drafter, gamma1: int, gamma2: int, retrieval: RetrievalSettings,
                 bottom_rule: str | None = None) -> None:
        check_gammas(gamma1, gamma2)
        retrieval.check()
        self.target, self.bottom = target, bottom
        self.gamma1, self.gamma2 = gamma1, gamma2
        self.max_tree_size = gamma2 + gamma1 + 1
        self.retrieval = RetrievalCache(target, retrieval, scratch=4 * (gamma2 + gamma1 + 2))
        self.bottom_rule = bottom_rule
        self.queries = torch.zeros(target.shape.layers, target.shape.heads, target.shape.head_dim,
                                   dtype=target.dtype, device=target.device)
        self.full: KVCache | None = None
        self.built = False  # the retrieval cache holds a selection of the bound full cache
        self.rebuild_due = False
        self.told = 0  # chain tokens the bottom holds as committed beyond the root, set by propose
        self.recent: deque[float] = deque(maxlen=8)
        self.stats = {"rounds": 0, "chains": 0, "chain_tokens": 0, "accepted": 0}

    def use_slot(self, slot: int) -> None:
        super().use_slot(slot)
        self.bottom.use_slot(slot)

    def reset(self, prompt, max_len):
        self.retrieval.settings.check(len(prompt))
        self.bottom.reset(prompt, max_len)
        self.full = None
        self.rebuild_due = False
        self.recent.clear()

    def bind(self, target_cache: KVCache) -> None:
        """The target's verifying forwards over its full cache write their root's rotated queries into
        `self.queries`: the next build's selection."""
        self.full = target_cache
        self.full.root_queries = self.queries
        self.built = False

    @torch.inference_mode()
    def _ensure_retrieval(self, root: int) -> None:
        if not self.built:
            # Built at the end of prefill from the query of the prompt's last token (scored, not committed).
            self.target.forward(torch.tensor([root]), torch.tensor([self.full.length]), self.full, None,
                                logits_rows=slice(0, 0))
            self.retrieval.build(self.full, self.queries)
            self.built = True
        elif self.rebuild_due:
            # Due since the last step's update, scored with that step root's query; built only now, so that
            # a generation's last step pays for none.
            self.retrieval.build(self.full, self.queries)
            self.rebuild_due = False
            self.recent.clear()

    @torch.inference_mode()
    def propose(self, root, params, draw, generator):
        self._ensure_retrieval(root)
        middle = self.retrieval.cache
        base = middle.length
        rule = choose_rule(self.bottom_rule, params, self.bottom.draws)
        greedy = params.greedy
        tokens, probs = [root], {}
        mid_root = root
        position = self.full.length  # the root's true position
        while len(tokens) - 1 < self.gamma2:
            proposal = self.bottom.propose(mid_root, params, rule.draw, generator)
            n = proposal.size
            offset = len(tokens) - 1
            mask = tree_attention_mask(ancestor_matrix(proposal.parents), middle.length, self.target.dtype) \
                if n > 1 else None
            positions = position + offset + torch.tensor(proposal.depths)
            logits = self.target.forward(torch.tensor(proposal.tokens), positions, middle, mask)
            path, next_token = rule.walk(proposal, logits, params, generator)
            middle.commit(None if path == list(range(len(path))) else torch.tensor(path), len(path))
            self.bottom.update(proposal, path, next_token)
            for i, node in enumerate(path[1:] + [None]):
                parent = path[i]
                if not greedy:
                    probs[len(tokens) - 1] = probabilities(logits[parent][None], params)[0]
                tokens.append(proposal.tokens[node] if node is not None else next_token)
            mid_root = next_token
            self.stats["rounds"] += 1
        middle.length = base
        tree = chain_tree(tokens, DETERMINISTIC if greedy else WITHOUT_REPLACEMENT)
        tree.draft_probs = probs
        self.told = len(tokens) - 2
        return tree

    def update(self, tree, accepted, next_token):
        accepted_drafts = len(accepted) - 1
        self.stats["chains"] += 1
        self.stats["chain_tokens"] += tree.size - 1
        self.stats["accepted"] += accepted_drafts
        self.recent.append(accepted_drafts / (tree.size - 1))
        # The bottom was told the whole chain; bring it back to what the target accepted.
        if accepted_drafts > self.told:
            self.bottom.extend([tree.tokens[-1]])
        else:
            self.bottom.rollback(self.told - accepted_drafts)
        # The engine committed the accepted tokens into the full cache just before this call.
        end = self.full.length
        start = end - len(accepted)
        low = self.retrieval.settings.rebuild_below
        self.rebuild_due = not self.retrieval.insert(self.full, start, end) or (
            low > 0 and len(self.recent) == self.recent.maxlen and sum(self.recent) / len(self.recent) < low)
