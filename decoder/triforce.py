"""TriForce: hierarchical speculation for long contexts.

- StreamingDrafter: a model with a StreamingLLM cache (attention sinks plus a window of recent tokens)
  drafts a chain of tokens. It is the bottom level of the hierarchy, or on its own the "StreamingLLM-only"
  drafter (the target itself with a streaming cache, for a target with no small sibling).
- RetrievalCache: the target's own KV cache reduced to a budget B: keys split into chunks of s tokens, each
  chunk scored per layer and KV head by (query . mean key of the chunk), the query summed over the query heads
  that share the KV head (GQA); the sink chunk and the unchunked tail are always kept, then the best chunks.
  Chunks are laid out best first, so the lowest-ranked slots are the last ones: accepted tokens overwrite
  them from the end. It is rebuilt from the latest query every `stride` tokens, when the slots run out, when the
  rolling acceptance of the top level falls below `rebuild_below`, or when its sequence drafts again after sitting
  out RESELECT_AFTER_IDLE_STEPS steps.
- HierarchicalDrafter: the middle level is the target over the retrieval cache. The bottom drafter proposes
  gamma1 tokens, the middle level verifies them (a verification rule from decoder/verify.py: the residual
  norm(max(p_hat - q, 0)) on rejection), and rounds repeat until at least gamma2 tokens are collected. The
  chain goes to the engine with p_hat at each node, so the top level (the target with its full cache)
  verifies it like any draft: the output is exactly the target's.
"""

from __future__ import annotations

import math
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
from specplan.decoder.drafters import (
    Drafter,
    ShadowDraft,
    TrieDrafter,
    choose_children,
    forward_all,
    propose_all,
    walk_shadows,
)
from specplan.decoder.model import ForwardItem, KVCache, LeanModel, causal_mask
from specplan.decoder.sampling import SamplingParams, probabilities
from specplan.decoder.tree import DETERMINISTIC, WITHOUT_REPLACEMENT, DraftTree, ancestor_matrix, tree_attention_mask
from specplan.decoder.verify import choose_rule

# A retrieval cache holds the chunks the query of the step that built it scored highest. A sequence that sat out this
# many steps (its drafts not paying: decoder/gate.py) resumes on text that selection was not made for, and its chains
# would be drafted over the chunks chosen for its question: it rebuilds on the resuming step's root instead
# (`bench/gate_replay.py` on documents no plan was solved on, docs/benchmark-log.md).
RESELECT_AFTER_IDLE_STEPS = 8


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

    def propose(self, root, params, draw, generator):
        return StreamingDrafter.propose_many([self], [root], [params], [draw], [generator])[0]

    def batches_with(self, other: Drafter) -> bool:
        return isinstance(other, StreamingDrafter) and other.model is self.model and other.gamma == self.gamma

    @staticmethod
    @torch.inference_mode()
    def propose_many(drafters: list[StreamingDrafter], roots: list[int], params: list[SamplingParams],
                     draws: list[str], generators: list[torch.Generator | None]) -> list[DraftTree]:
        """The chains of several sequences (one model and gamma, each over its own streaming cache), drafted
        together: one batched forward of the tokens fed before the roots and the roots, then one per depth."""
        model, gamma = drafters[0].model, drafters[0].gamma
        items = []
        for drafter, root in zip(drafters, roots):
            chain = drafter.pending + [root]
            drafter.pending = []
            drafter._make_room(len(chain) + gamma)
            first = drafter.positions - (len(chain) - 1)
            mask = causal_mask(drafter.cache.length, len(chain), model.dtype, model.device) if len(chain) > 1 else None
            items.append(ForwardItem(torch.tensor(chain), torch.arange(first, first + len(chain)), drafter.cache,
                                     mask, slice(len(chain) - 1, None)))
        logits = forward_all(model, items)
        scratches = []  # each root's slot; draft tokens follow it
        for drafter, item in zip(drafters, items):
            drafter.cache.commit(None, len(item.tokens) - 1)
            scratches.append(drafter.cache.length)
        draws = [DETERMINISTIC if p.greedy else draw for p, draw in zip(params, draws)]
        chains = [[root] for root in roots]
        probs: list[dict[int, torch.Tensor]] = [{} for _ in drafters]
        for depth in range(gamma):
            for i, scored in enumerate(logits):
                picks, distribution = choose_children(scored.float(), [1], params[i], draws[i], generators[i])
                if distribution is not None:
                    probs[i][depth] = distribution[0]
                chains[i].append(picks[0][0])
            if depth < gamma - 1:
                items = []
                for drafter, chain, scratch in zip(drafters, chains, scratches):
                    drafter.cache.length = scratch + depth + 1
                    items.append(ForwardItem(torch.tensor([chain[-1]]), torch.tensor([drafter.positions + depth + 1]),
                                             drafter.cache, None))
                logits = forward_all(model, items)
                for drafter, scratch in zip(drafters, scratches):
                    drafter.cache.length = scratch
        trees = []
        for chain, chain_probs, draw in zip(chains, probs, draws):
            trees.append(chain_tree(chain, draw))
            trees[-1].draft_probs = chain_probs
        return trees

    def update(self, tree, accepted, next_token):
        # The root and the first gamma - 1 draft tokens were forwarded into slots after the prefix.
        forwarded = min(len(accepted), self.gamma)
        self.cache.commit(None, forwarded)
        self.pending = [tree.tokens[v] for v in accepted[forwarded:]]
        self.positions += len(accepted)

    def extend(self, tokens: list[int]) -> None:
        self.pending.extend(tokens)
        self.positions += len(tokens)
        if len(self.pending) >= self.window:  # a hierarchy sitting steps out: only the window's tokens are read
            self._flush_pending_into_window()

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
            self.cache = KVCache(shape, budget + s + self.scratch, full.k.dtype, self.model.device)
            if self.model.has_windows:
                self.cache.track_positions()  # the slots hold chosen chunks: their positions set the windows' masks
        group = shape.heads // shape.kv_heads
        means = full.k[:, :, :chunks * s].float().view(shape.layers, shape.kv_heads, chunks, s, -1).mean(3)
        q = queries.float().to(means.device).view(shape.layers, shape.kv_heads, group, -1).sum(2)
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
        # A full cache in host memory (--offload kv) sends each head's chosen rows to the device in one copy.
        for source, target in ((full.k, self.cache.k), (full.v, self.cache.v)):
            for layer in range(shape.layers):
                for head in range(shape.kv_heads):
                    if source.device == target.device:
                        torch.index_select(source[layer, head], 0, index[layer, head], out=target[layer, head, :kept])
                    else:
                        target[layer, head, :kept].copy_(torch.index_select(source[layer, head], 0,
                                                                            index[layer, head]))
        if self.cache.key_positions is not None:
            self.cache.key_positions[:, :, :kept] = index.to(self.cache.key_positions.device)
        self.cache.length = kept
        self.next_slot = budget - 1
        self.inserted = 0
        self.builds += 1

    def insert(self, full: KVCache, start: int, end: int) -> bool:
        """Copy the committed tokens start..end-1 over the lowest-ranked slots; False when a rebuild is due."""
        count = end - start
        if self.next_slot - count + 1 < self.settings.chunk or self.inserted + count > self.settings.stride:
            return False
        slots = torch.arange(self.next_slot, self.next_slot - count, -1, device=self.cache.k.device)
        self.cache.k[:, :, slots] = full.k[:, :, start:end].to(self.cache.k.device)
        self.cache.v[:, :, slots] = full.v[:, :, start:end].to(self.cache.v.device)
        if self.cache.key_positions is not None:
            self.cache.key_positions[:, :, slots] = torch.arange(start, end, device=slots.device)
        self.next_slot -= count
        self.inserted += count
        return True


class HierarchicalDrafter(Drafter):
    """Bottom drafter -> target over a retrieval cache -> (the engine's) target over the full cache. A schedule's
    setting (`draft_nodes`) is the chain's length, gamma2 = nodes - 1, at most the plan's; a step it sits out (the
    schedule off, its drafts declined) verifies the root alone while the bottom and the retrieval cache keep up with
    the text. A sequence's first step is such a step: its forward gives the query of the first build."""

    draws = (DETERMINISTIC, WITHOUT_REPLACEMENT)
    gated = True

    def __init__(self, target: LeanModel, bottom: Drafter, gamma1: int, gamma2: int, retrieval: RetrievalSettings,
                 bottom_rule: str | None = None) -> None:
        check_gammas(gamma1, gamma2)
        retrieval.check()
        self.target, self.bottom = target, bottom
        self.gamma1, self.gamma2 = gamma1, gamma2
        self.planned_gamma2 = gamma2
        self.max_tree_size = gamma2 + gamma1 + 1
        self.retrieval = RetrievalCache(target, retrieval, scratch=4 * (gamma2 + gamma1 + 2))
        self.bottom_rule = bottom_rule
        self.queries = torch.zeros(target.shape.layers, target.shape.heads, target.shape.head_dim,
                                   dtype=target.dtype, device=target.device)
        self.full: KVCache | None = None
        # `queries` hold a verified step root's: a sequence's first step is plain, and its forward over the full cache
        # gives the query its first build scores with (no forward of its own, and the first token comes at a plain
        # step's latency)
        self.queried = False
        self.built = False  # the retrieval cache holds a selection of the bound full cache
        self.rebuild_due = False
        self.idle_steps = 0  # steps sat out since its last drafted one (RESELECT_AFTER_IDLE_STEPS)
        self.told = 0  # chain tokens the bottom holds as committed beyond the root, set by propose
        self.recent: deque[float] = deque(maxlen=8)
        # a trie bottom's first-round drafts at the steps sat out, walked by the text that follows (`shadow_passes`)
        self.pending_shadows: list[ShadowDraft] = []
        self.shadow_rounds: list[int] = []  # the middle rounds each settled one stands for, not yet drained
        self.stats = {"rounds": 0, "chains": 0, "chain_tokens": 0, "accepted": 0}

    def use_slot(self, slot: int) -> None:
        super().use_slot(slot)
        self.bottom.use_slot(slot)

    def reset(self, prompt, max_len):
        self.retrieval.settings.check(len(prompt))
        self.bottom.reset(prompt, max_len)
        self.full = None
        self.rebuild_due = False
        self.idle_steps = 0
        self.recent.clear()
        self.pending_shadows, self.shadow_rounds = [], []

    def bind(self, target_cache: KVCache) -> None:
        """The target's verifying forwards over its full cache write their root's rotated queries into
        `self.queries`: the next build's selection."""
        self.full = target_cache
        self.full.root_queries = self.queries
        self.queried = self.built = False

    @staticmethod
    @torch.inference_mode()
    def _ensure_retrieval(drafters: list[HierarchicalDrafter]) -> None:
        """Each drafter's retrieval cache ready for its next round: built at its sequence's first drafted step, or
        rebuilt when due since the last step's update or when it resumes drafting after RESELECT_AFTER_IDLE_STEPS
        steps sat out, scored with the last step root's query either way (built only now, so that a generation's
        last step pays for none)."""
        for drafter in drafters:
            drafter.rebuild_due |= drafter.built and drafter.idle_steps >= RESELECT_AFTER_IDLE_STEPS
            drafter.idle_steps = 0
            drafter.started_now = not drafter.built
            if not drafter.built or drafter.rebuild_due:
                drafter.retrieval.build(drafter.full, drafter.queries)
                drafter.built, drafter.rebuild_due = True, False
                drafter.recent.clear()

    def draft_nodes(self, nodes):
        self.gamma2 = min(nodes, self.planned_gamma2 + 1) - 1

    def drafts_now(self) -> bool:
        return self.drafting and self.gamma2 > 0 and self.queried

    def idle(self, root):
        self._follow_shadows(root)
        self.bottom.extend([root])  # the root is committed text to the bottom, whatever the target emits after it
        self.idle_steps += 1
        if isinstance(self.bottom, TrieDrafter) and self.gamma2 > 0:  # its draft costs no forward
            shadow = self.bottom.committed_draft()
            if shadow.matched:
                self.pending_shadows.append(shadow)
            else:  # no match: every round would add the middle's one token
                self.shadow_rounds.append(self.gamma2)
        return super().idle(root)

    def _follow_shadows(self, token: int) -> None:
        """The text's next token down the pending shadow drafts. One it leaves stands for a chain whose every round
        lands as its first would have: the bottom's matched tokens and the middle's own, gamma2 tokens in
        ceil(gamma2 / (matched + 1)) middle rounds, the passes a drafted step there would have taken (its middle
        taken to agree with the text)."""
        self.pending_shadows, settled = walk_shadows(self.pending_shadows, [token])
        if self.gamma2 > 0:
            self.shadow_rounds += [math.ceil(self.gamma2 / shadow.emitted) for shadow in settled]

    def shadow_passes(self):
        rounds, self.shadow_rounds = self.shadow_rounds, []
        return rounds

    def propose(self, root, params, draw, generator):
        if not self.drafts_now():
            return self.idle(root)
        return HierarchicalDrafter.propose_many([self], [root], [params], [draw], [generator])[0]

    def batches_with(self, other: Drafter) -> bool:
        return isinstance(other, HierarchicalDrafter) and other.target is self.target

    @staticmethod
    @torch.inference_mode()
    def propose_many(drafters: list[HierarchicalDrafter], roots: list[int], params: list[SamplingParams],
                     draws: list[str], generators: list[torch.Generator | None]) -> list[DraftTree]:
        """The chains of several sequences, their rounds in step: each round, the bottoms draft (together where
        they batch), then one batched middle forward scores every sequence's proposal over its own retrieval
        cache; a sequence leaves the rounds once it holds gamma2 tokens."""
        HierarchicalDrafter._ensure_retrieval(drafters)
        for drafter in drafters:
            drafter.pending_shadows = []  # a drafted step's own passes count from here
        chains = [_MiddleChain(*args) for args in zip(drafters, roots, params, generators)]
        while active := [chain for chain in chains if not chain.done]:
            proposals = propose_all([c.drafter.bottom for c in active], [c.mid_root for c in active],
                                    [c.params for c in active], [c.rule.draw for c in active],
                                    [c.generator for c in active])
            items = [chain.middle_item(proposal) for chain, proposal in zip(active, proposals)]
            for chain, proposal, scored in zip(active, proposals, forward_all(drafters[0].target, items)):
                chain.take(proposal, scored)
        return [chain.finish() for chain in chains]

    def update(self, tree, accepted, next_token):
        self.queried = True
        if tree.size == 1:  # a step sat out: the retrieval cache takes the root (where built), the bottom has it
            self._insert(len(accepted))
            return
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
        self._insert(len(accepted))
        low = self.retrieval.settings.rebuild_below
        failing = len(self.recent) == self.recent.maxlen and sum(self.recent) / len(self.recent) < low
        self.rebuild_due |= low > 0 and failing

    def _insert(self, count: int) -> None:
        """The `count` tokens the engine just committed into the full cache, into the retrieval cache (a rebuild
        due where they do not fit; nothing before its first build)."""
        if self.built and not self.rebuild_due:
            end = self.full.length
            self.rebuild_due = not self.retrieval.insert(self.full, end - count, end)


class _MiddleChain:
    """One sequence's chain while a HierarchicalDrafter's rounds build it: the bottom drafts from `mid_root`, the
    target over the retrieval cache verifies, and the accepted tokens and the correction join the chain."""

    def __init__(self, drafter: HierarchicalDrafter, root: int, params: SamplingParams,
                 generator: torch.Generator | None) -> None:
        self.drafter, self.params, self.generator = drafter, params, generator
        self.rule = choose_rule(drafter.bottom_rule, params, drafter.bottom.draws)
        self.middle = drafter.retrieval.cache
        self.base = self.middle.length
        self.position = drafter.full.length  # the root's true position
        self.tokens, self.probs = [root], {}
        self.mid_root = root
        self.rounds = 0

    @property
    def done(self) -> bool:
        return len(self.tokens) - 1 >= self.drafter.gamma2

    def middle_item(self, proposal: DraftTree) -> ForwardItem:
        target = self.drafter.target
        mask = tree_attention_mask(ancestor_matrix(proposal.parents), self.middle.length, target.dtype) \
            if proposal.size > 1 else None
        positions = self.position + len(self.tokens) - 1 + torch.tensor(proposal.depths)
        return ForwardItem(torch.tensor(proposal.tokens), positions, self.middle, mask)

    def take(self, proposal: DraftTree, logits: torch.Tensor) -> None:
        path, next_token = self.rule.walk(proposal, logits, self.params, self.generator)
        self.middle.commit(None if path == list(range(len(path))) else torch.tensor(path), len(path))
        self.drafter.bottom.update(proposal, path, next_token)
        for i, node in enumerate(path[1:] + [None]):
            if not self.params.greedy:
                self.probs[len(self.tokens) - 1] = probabilities(logits[path[i]][None], self.params)[0]
            self.tokens.append(proposal.tokens[node] if node is not None else next_token)
        self.mid_root = next_token
        self.rounds += 1
        self.drafter.stats["rounds"] += 1

    def finish(self) -> DraftTree:
        self.middle.length = self.base
        tree = chain_tree(self.tokens, DETERMINISTIC if self.params.greedy else WITHOUT_REPLACEMENT)
        tree.draft_probs = self.probs
        self.drafter.told = len(self.tokens) - 2
        self.drafter.draft_passes = self.rounds
        return tree
