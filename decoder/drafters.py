"""Drafters: who proposes the token tree. One interface for a draft model with a fixed tree shape (Sequoia),
a trie (Lookahead) and a hierarchy (TriForce); verification is kept apart (decoder/verify.py)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch

from specplan.core.errors import UserError
from specplan.core.plan_schema import ScheduleEntry, TokenTree
from specplan.decoder.draft_rules import NO_STOP, ChainStop, DraftRule, draft_confidence
from specplan.decoder.model import ForwardItem, KVCache, LeanModel, causal_mask, prefill_together
from specplan.decoder.sampling import SamplingParams, probabilities
from specplan.decoder.tree import (
    DETERMINISTIC,
    WITH_REPLACEMENT,
    WITHOUT_REPLACEMENT,
    DraftTree,
    ancestor_matrix,
    tree_attention_mask,
)
from specplan.decoder.trie import Trie


class Drafter(ABC):
    draws: tuple[str, ...] = (DETERMINISTIC,)  # the ways it can choose children
    max_tree_size: int = 1
    role_suffix: str = ""  # appended to the roles of the caches it takes from a model (LeanModel.cache_for)
    gated: bool = False  # whether its sequence may sit steps out (`idle`) by a per-request decision (decoder/gate.py)
    shadows: bool = False  # whether it drafts in the shadow of the steps it sits out (`shadow_yields`)
    drafting: bool = True  # the coming step's decision: False, `idle` gives the step's tree instead of `propose`
    rule: DraftRule | None = None  # an engine's drafting rule, deciding the length of every step (draft_rules.py)
    # The last proposal paid a start not timed apart (a retrieval cache's first build): that step is no measure of
    # what a drafted step costs (decoder/gate.py, StepClock)
    started_now: bool = False
    # The tokens the last proposal read before drafting (a draft model's prompt, the steps it sat out) and their
    # seconds, timed apart: the rest of its step is what a drafted step costs
    started_reading: tuple[int, float] | None = None
    # The draft forwards of its last proposal where their number follows the text (a TriForce chain's middle rounds:
    # where its bottom misses, a round adds a token, where it lands several), which a drafted step's price follows
    # (StepClock.pass_price); None where a drafted step's forwards are the setting's alone
    draft_passes: int | None = None

    @property
    def reading_seconds(self) -> float:
        return self.started_reading[1] if self.started_reading is not None else 0.0

    def start_tokens(self) -> int:
        """The tokens the drafter reads at its next drafted step before it drafts (a draft model's prompt, the steps
        it sat out): what starting or resuming costs beyond the drafted step itself; 0 for a drafter that reads none."""
        return 0

    def use_slot(self, slot: int) -> None:
        """Take its caches of a batch's slot `slot`: each sequence in flight has its own (decoder/batching.py)."""
        self.role_suffix = f".{slot}" if slot else ""

    def reset(self, prompt: list[int], max_len: int) -> None:
        """Start a new sequence; the last prompt token is the first root."""

    def prepare(self, max_len: int) -> None:
        """Make ahead what a sequence of a target cache of `max_len` slots will need (a draft model's cache and
        its CUDA graphs), so that `reset` and the first steps find it made."""

    @abstractmethod
    def propose(self, root: int, params: SamplingParams, draw: str, generator: torch.Generator | None) -> DraftTree:
        """A tree whose node 0 is `root`."""

    def drafts_now(self) -> bool:
        """Whether the coming step drafts: the per-request decision, and the setting the drafter follows (a
        schedule's "off" drafts nothing)."""
        return self.drafting

    def idle(self, root: int) -> DraftTree:
        """The tree of a step this sequence does not draft: its root alone (a gated drafter keeps up with the text,
        to draft from it at a later step)."""
        return DraftTree([root], [-1])

    def update(self, tree: DraftTree, accepted: list[int], next_token: int | None) -> None:
        """The target accepted `accepted` (node indices, root first); `next_token` is the next root, or None
        when generation ends inside the accepted path."""

    def shadow_yields(self) -> list[ShadowDraft]:
        """For steps the sequence sat out (and, sharing a step's rows, every step: TrieDrafter.survey), the drafts it
        would have scored, each walked by the text until the text left it, since the last call: a drafter whose
        drafts cost no forward (a trie) drafts in the shadow of the steps it sits out, so that the per-request
        decision sees what drafting would yield without paying for a probe (decoder/gate.py). Greedy, a draft's
        `emitted` is exactly what the drafted step would have emitted (the tree's longest path the text follows, and
        the target's next token); sampled, it is the greedy walk's estimate. [] for a drafter whose drafts cost a
        forward."""
        return []

    def shadow_passes(self) -> list[int]:
        """For steps the sequence sat out, the draft forwards a drafted step would have taken there where their
        number follows the text (`draft_passes`), told without a forward, since the last call: so that a sequence
        sitting out sees its drafted step's price fall (or rise) with the text (decoder/gate.py). [] where they
        cannot be told so."""
        return []

    def finish(self) -> None:
        """The sequence is done (a batch's slot frees it): let go of what only it needed."""

    def follow(self, entry: ScheduleEntry, gated: bool = False) -> None:
        """Draft with a plan schedule's setting for the batch size of the coming step (core/plan_schema.py); an off
        entry's candidate where a per-request decision (`gated`) keeps it from drafting until it pays."""
        self.draft_nodes(entry.nodes(gated))

    def draft_nodes(self, nodes: int) -> None:
        """Draft trees of up to `nodes` nodes, root included, from the coming step on (1: none)."""
        raise UserError(f"{type(self).__name__} does not draft to a length it is given")

    def bind(self, target_cache: KVCache) -> None:
        """The engine's target cache after prefill (a drafter built on the target's own cache reads it)."""

    def batches_with(self, other: Drafter) -> bool:
        """Whether `propose_many` drafts this drafter's sequence and `other`'s together (one model's batched
        forwards); by default each drafter proposes alone."""
        return False

    @staticmethod
    def propose_many(drafters: list[Drafter], roots: list[int], params: list[SamplingParams], draws: list[str],
                     generators: list[torch.Generator | None]) -> list[DraftTree]:
        """The trees of several sequences, each from its own drafter (drafters that batch with each other)."""
        return [d.propose(*args) for d, *args in zip(drafters, roots, params, draws, generators)]

    def target_tree_sizes(self) -> tuple[int, ...]:
        """The tree sizes the target verifies, whose CUDA graphs are captured with a new cache (before decoding
        starts) rather than on first use; () where that is not known ahead (captured on first use)."""
        return ()

    # A drafter used as the bottom of a hierarchy follows speculative tokens that the top may reject:
    def extend(self, tokens: list[int]) -> None:
        """Take `tokens` as committed after the current root."""
        raise NotImplementedError(f"{type(self).__name__} cannot be the bottom of a hierarchy")

    def rollback(self, count: int) -> None:
        """Forget the last `count` committed tokens."""
        raise NotImplementedError(f"{type(self).__name__} cannot be the bottom of a hierarchy")


def _seconds_since(began: float, device: torch.device) -> float:
    """The seconds since `began`, the work queued on `device` (a GPU's) done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


def forward_all(model: LeanModel, items: list[ForwardItem]) -> list[torch.Tensor]:
    return model.forward_many(items) if len(items) > 1 else [model.forward(*items[0])]


def propose_all(drafters: list[Drafter], roots: list[int], params: list[SamplingParams], draws: list[str],
                generators: list[torch.Generator | None]) -> list[DraftTree]:
    """Every sequence's next tree, each from its own drafter: drafters that batch together (one draft model's
    sequences) propose in one call, the others one by one; a sequence sitting the step out, its root alone."""
    trees: list[DraftTree | None] = [None] * len(drafters)
    for i, drafter in enumerate(drafters):
        if not drafter.drafts_now():
            trees[i] = drafter.idle(roots[i])
    left = [i for i in range(len(drafters)) if trees[i] is None]
    while left:
        lead = drafters[left[0]]
        group = [i for i in left if i == left[0] or lead.batches_with(drafters[i])]
        drafted = type(lead).propose_many([drafters[i] for i in group], [roots[i] for i in group],
                                          [params[i] for i in group], [draws[i] for i in group],
                                          [generators[i] for i in group])
        for i, tree in zip(group, drafted):
            trees[i] = tree
        left = [i for i in left if i not in group]
    return trees


class NoDrafter(Drafter):
    """Plain autoregressive decoding: a one-node tree (as a hierarchy's bottom: the two-level variant)."""

    def propose(self, root, params, draw, generator):
        return DraftTree([root], [-1])

    def drafts_now(self) -> bool:
        return False  # its steps are plain ones, as a batch's clock counts them

    def target_tree_sizes(self):
        return (1,)

    def extend(self, tokens):
        pass

    def rollback(self, count):
        pass


def choose_children(logits: torch.Tensor, counts: list[int], params: SamplingParams, draw: str,
                    generator: torch.Generator | None) -> tuple[list[list[int]], torch.Tensor | None]:
    """Children tokens for each row of `logits` ([rows, vocab]) and the distributions they were drawn from.

    Greedy or deterministic: the top-k of the logits. Without replacement: Gumbel-top-k, whose order is the
    sequential draw order; once a row's support is used up the rest is uniform over tokens not yet drawn
    (their keys sit below every positive-probability token). With replacement: i.i.d. draws.
    """
    widest = max(counts)
    if params.greedy or draw == DETERMINISTIC:
        top = torch.topk(logits, widest, dim=-1).indices
        return [top[i, :c].tolist() for i, c in enumerate(counts)], None
    probs = probabilities(logits, params)
    if draw == WITH_REPLACEMENT:
        picks = torch.multinomial(probs, widest, replacement=True, generator=generator)
        return [picks[i, :c].tolist() for i, c in enumerate(counts)], probs
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device).clamp_(min=1e-20)
    gumbel = -torch.log(-torch.log(uniform))
    keys = torch.where(probs > 0, probs.log(), torch.full_like(probs, -1e4)) + gumbel
    top = torch.topk(keys, widest, dim=-1).indices
    return [top[i, :c].tolist() for i, c in enumerate(counts)], probs


@dataclass(frozen=True)
class TreeShape:
    """A fixed tree's layout for drafting it level by level: expanded nodes (those with children) get draft-cache
    slots in BFS order, root first; `levels[k]`: the expanded nodes at depth k."""

    parents: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    levels: tuple[tuple[int, ...], ...]
    slot: dict[int, int]
    allowed: torch.Tensor  # [expanded, expanded] bool: the ancestor matrix of the expanded nodes

    @classmethod
    def of(cls, parents: list[int]) -> TreeShape:
        shape = DraftTree([0] * len(parents), parents)
        child_counts = [len(c) for c in shape.children]
        expanded = [v for v in range(len(parents)) if child_counts[v] > 0]
        slot = {v: i for i, v in enumerate(expanded)}
        levels: list[list[int]] = []
        for v in expanded:
            if shape.depths[v] == len(levels):
                levels.append([])
            levels[shape.depths[v]].append(v)
        allowed = ancestor_matrix([slot.get(parents[v], -1) for v in expanded])
        return cls(tuple(parents), tuple(tuple(c) for c in shape.children), tuple(tuple(level) for level in levels),
                   slot, allowed)


class SequoiaDrafter(Drafter):
    """A draft model grows a fixed tree shape level by level: one draft forward per level of expanded nodes. A
    chain follows a schedule's draft length per batch size (`follow`): the chain cut to that many tokens, or none.
    The draft prefills a prompt at the request's first drafted step, not as it joins: a request that never drafts
    (a schedule off at its batch sizes, its drafts declined) never pays the draft's prefill."""

    draws = (DETERMINISTIC, WITHOUT_REPLACEMENT, WITH_REPLACEMENT)
    gated = True

    def __init__(self, model: LeanModel, parents: list[int]) -> None:
        self.model = model
        self.parents = list(parents)
        self.max_tree_size = len(parents)
        self.full_shape = self.shape = TreeShape.of(self.parents)
        self.cut_shapes = {len(parents): self.full_shape}  # a chain cut to each size a schedule asked for
        self.is_chain = TokenTree.from_parents(self.parents).is_chain
        self.cache: KVCache | None = None
        self.unprefilled: list[int] | None = None  # the prompt (all but its last token) the draft has not read yet
        self.pending: list[int] = []
        self.proposed = self.shape  # the shape of the tree last proposed (a chain stopped early: shorter)

    def draft_nodes(self, nodes):
        if nodes > 1 and not self.is_chain:
            raise UserError("a schedule's or a rule's draft lengths cut a chain; this plan's tree branches")
        self.shape = self._cut(min(nodes, self.max_tree_size))

    @property
    def chain_stop(self) -> ChainStop:
        """When its chain stops early: its engine rule's (decoder/draft_rules.py), else never."""
        return self.rule.stop if self.rule is not None else NO_STOP

    def _cut(self, size: int) -> TreeShape:
        if size not in self.cut_shapes:
            self.cut_shapes[size] = TreeShape.of(self.parents[:size])
        return self.cut_shapes[size]

    def drafts_now(self) -> bool:
        return self.drafting and len(self.shape.parents) > 1

    def reset(self, prompt: list[int], max_len: int) -> None:
        self.cache = self.model.cache_for(max_len, "draft" + self.role_suffix)
        self.unprefilled = prompt[:-1]
        self.pending = []

    def start_tokens(self) -> int:
        """The prompt not read yet, and the roots of the steps it sat out (beyond the one leaf a drafted step leaves
        for the next: `update`)."""
        return (len(self.unprefilled) if self.unprefilled is not None else 0) + max(len(self.pending) - 1, 0)

    @staticmethod
    def _read_first(drafters: list[SequoiaDrafter]) -> None:
        """What each drafter reads before it drafts, timed apart from the drafted step (`started_reading`): the
        prefill `reset` deferred, as it would have run then; the roots of the steps it sat out but the last (the
        chain of its drafted step feeds that one with the root, as after any step whose last token was a leaf),
        every drafter's in one batched forward whose seconds they share by tokens."""
        model = drafters[0].model
        tokens, seconds = [0] * len(drafters), [0.0] * len(drafters)
        for i, drafter in enumerate(drafters):
            if drafter.unprefilled is not None:
                began = time.perf_counter()
                model.prefill(torch.tensor(drafter.unprefilled, dtype=torch.long), drafter.cache, logits=False)
                tokens[i], seconds[i] = len(drafter.unprefilled), _seconds_since(began, model.device)
                drafter.unprefilled = None
        behind = [i for i, drafter in enumerate(drafters) if len(drafter.pending) > 1]
        if behind:
            began = time.perf_counter()
            prefill_together(model, [torch.tensor(drafters[i].pending[:-1]) for i in behind],
                             [drafters[i].cache for i in behind])
            shared = _seconds_since(began, model.device) / sum(len(drafters[i].pending) - 1 for i in behind)
            for i in behind:
                tokens[i] += len(drafters[i].pending) - 1
                seconds[i] += shared * (len(drafters[i].pending) - 1)
                drafters[i].pending = drafters[i].pending[-1:]
        for drafter, read, took in zip(drafters, tokens, seconds):
            drafter.started_reading = (read, took) if read else None

    def target_tree_sizes(self):
        return (self.max_tree_size,)

    def prepare(self, max_len):
        cache = self.model.cache_for(max_len, "draft" + self.role_suffix)
        if self.model.graphed is not None:  # the chain fed before the root (1 or 2 tokens), then each level
            self.model.graphed.capture(cache, {1, 2, *(len(level) for level in self.full_shape.levels[1:])})

    def propose(self, root, params, draw, generator):
        return SequoiaDrafter.propose_many([self], [root], [params], [draw], [generator])[0]

    def batches_with(self, other: Drafter) -> bool:
        return (isinstance(other, SequoiaDrafter) and other.model is self.model
                and (other.shape.parents == self.shape.parents or (self.is_chain and other.is_chain)))

    @staticmethod
    @torch.inference_mode()
    def propose_many(drafters: list[SequoiaDrafter], roots: list[int], params: list[SamplingParams],
                     draws: list[str], generators: list[torch.Generator | None]) -> list[DraftTree]:
        """The trees of several sequences (drafters of one model, each over its own cache, all of one tree shape or
        all chains of their own lengths), grown together: one batched draft forward for the chains fed before the
        roots, then one per level over the sequences still drafting. A chain with a `chain_stop` ends after a
        token drafted with too little confidence (and is dropped if too short)."""
        model = drafters[0].model
        SequoiaDrafter._read_first(drafters)
        widest = max((drafter.shape for drafter in drafters), key=lambda shape: len(shape.parents))
        tokens = [[root] + [0] * (len(drafter.shape.parents) - 1) for drafter, root in zip(drafters, roots)]
        sizes = [len(t) for t in tokens]
        draft_probs: list[dict[int, torch.Tensor]] = [{} for _ in drafters]
        tree_draws = [DETERMINISTIC if p.greedy else draw for p, draw in zip(params, draws)]
        if max(sizes) > 1:
            items = []
            for drafter, root in zip(drafters, roots):
                chain, base = drafter.pending + [root], drafter.cache.length
                mask = causal_mask(base, len(chain), model.dtype, model.device) if len(chain) > 1 else None
                items.append(ForwardItem(torch.tensor(chain), torch.arange(base, base + len(chain)), drafter.cache,
                                         mask, slice(len(chain) - 1, None)))
            logits = forward_all(model, items)
            bases = []
            for drafter in drafters:
                drafter.cache.commit(None, len(drafter.pending))
                drafter.pending = []
                bases.append(drafter.cache.length)  # the root now sits, uncommitted, in slot `base`
            live = list(range(len(drafters)))
            for depth, level in enumerate(widest.levels):
                live = [i for i in live if depth < len(drafters[i].shape.levels)]
                if not live:
                    break
                if depth > 0:
                    first = widest.slot[level[0]]
                    rows = torch.arange(first, first + len(level))
                    items = []
                    for i in live:
                        drafters[i].cache.length = bases[i] + first  # the level's keys go to slots base + first ...
                        mask = tree_attention_mask(widest.allowed[:, :first + len(level)], bases[i], model.dtype, rows)
                        items.append(ForwardItem(torch.tensor([tokens[i][v] for v in level]),
                                                 torch.full((len(level),), bases[i] + depth), drafters[i].cache, mask))
                    logits = forward_all(model, items)
                    for i in live:
                        drafters[i].cache.length = bases[i]
                counts = [len(widest.children[v]) for v in level]
                scored_by = dict(zip(range(len(drafters)) if depth == 0 else live, logits))
                still = []
                for i in live:
                    scored = scored_by[i]
                    picks, probs = choose_children(scored.float(), counts, params[i], tree_draws[i], generators[i])
                    for row, v in enumerate(level):
                        for child, token in zip(widest.children[v], picks[row]):
                            tokens[i][child] = token
                        if probs is not None:
                            draft_probs[i][v] = probs[row]
                    stop = drafters[i].chain_stop
                    if stop.below > 0 and float(draft_confidence(scored[-1:], stop.top_k)[0]) < stop.below:
                        sizes[i] = depth + 2 if stop.keeps_last else depth + 1  # the token just drafted in or out
                    else:
                        still.append(i)
                live = still
        trees = []
        for i, drafter in enumerate(drafters):
            if sizes[i] - 1 < drafter.chain_stop.min_tokens:
                sizes[i] = 1  # too short a chain: dropped, its draft forwards spent
            drafter.proposed = drafter._cut(sizes[i])
            parents = list(drafter.proposed.parents)
            trees.append(DraftTree(tokens[i][:sizes[i]], parents, tree_draws[i],
                                   {v: q for v, q in draft_probs[i].items()
                                    if v < sizes[i] and drafter.proposed.children[v]}))
        return trees

    def idle(self, root):
        self.pending.append(root)  # fed to the draft model, with what follows it, at the next drafted step
        return super().idle(root)

    def update(self, tree, accepted, next_token):
        if not self.drafts_now():  # the root sits in `pending`; the next root comes with the next step
            return
        slot = self.proposed.slot
        kept = [v for v in accepted if v in slot]
        slots = [slot[v] for v in kept]
        self.cache.commit(None if slots == list(range(len(slots))) else torch.tensor(slots), len(slots))
        if accepted[-1] not in slot:  # a leaf the draft never ran: feed it with the next root
            self.pending = [tree.tokens[accepted[-1]]]


@dataclass
class ShadowDraft:
    """A draft of a step its sequence sat out (TrieDrafter.idle), or the longest it could have scored
    (TrieDrafter.survey), walked down by the text that followed."""

    tokens: list[int]
    parents: list[int]
    node: int = 0  # the deepest node the text has followed so far
    path: list[int] = field(default_factory=list)  # the nodes on the way to it, root excluded (increasing)
    after: int | None = None  # a survey's: what the sequence's last settled survey emitted (decoder/sharing.py)

    @property
    def matched(self) -> bool:
        """False where the trie had no match: the step would have scored its root alone and emitted one token."""
        return len(self.tokens) > 1

    @property
    def emitted(self) -> int:
        """What the step would have emitted: the drafted tokens the text followed and the target's next token."""
        return len(self.path) + 1

    def emitted_within(self, nodes: int) -> int:
        """What the draft cut to its first `nodes` nodes would have emitted: a trie's retrieval adds nodes in one
        order whatever its length, so its first nodes are its shorter draft (decoder/trie.py)."""
        return 1 + sum(1 for node in self.path if node < nodes)

    def follow(self, token: int) -> bool:
        """The text's next token: True while the path can still grow (it matched a child that has children)."""
        child = next((i for i, p in enumerate(self.parents) if p == self.node and self.tokens[i] == token), None)
        if child is None:
            return False
        self.node = child
        self.path.append(child)
        return child in self.parents


def walk_shadows(shadows: list[ShadowDraft], emitted: list[int]) -> tuple[list[ShadowDraft], list[ShadowDraft]]:
    """The text's next tokens, `emitted`, walked down each shadow draft: those still followed, and those it left."""
    pending, settled = [], []
    for shadow in shadows:
        (pending if all(shadow.follow(token) for token in emitted) else settled).append(shadow)
    return pending, settled


class TrieDrafter(Drafter):
    """Lookahead: drafts retrieved from a token trie of the prompt and of the output so far. The trie lives
    across requests (outputs of earlier requests keep helping); a request's prompt branches leave with it.
    `sequence[:length]` holds the committed tokens before the current root, which `propose` writes after them;
    the windows of `sequence[:counted]` are in the trie: the text so far and the root.

    `shared`: the trie is shared by the drafters of a batch's slots (every output teaches it, the Ant reference's
    design): a finished request withdraws its own prompt's windows, leaving the other live prompts' branches."""

    gated = True
    shadows = True

    def __init__(self, trie: Trie, shared: bool = False) -> None:
        self.trie = trie
        self.pending: list[ShadowDraft] = []  # drafts of steps sat out (or surveyed), the text not past them yet
        self.settled: list[ShadowDraft] = []  # those the text has left since the last shadow_yields
        self.surveyed: tuple[list[int], list[int]] | None = None  # this step's longest draft (`survey`)
        self.last_emitted: int | None = None  # what the last settled survey would have emitted
        self.shared = shared
        self.max_tree_size = trie.settings.decoding_length
        self.sequence = np.zeros(0, dtype=np.int64)
        self.length = 0
        self.counted = 0
        self.prompt_length = 0
        self.live_request = False
        self.decoding_length = trie.settings.decoding_length  # a schedule's, at most the trie's own; 1: off

    def draft_nodes(self, nodes):
        self.decoding_length = min(nodes, self.max_tree_size)  # the trie's buffers hold its own length at most

    def reset(self, prompt, max_len):
        self.finish()
        self.sequence = np.zeros(max_len + self.max_tree_size + 1, dtype=np.int64)
        self.sequence[:len(prompt)] = prompt
        self.length = len(prompt) - 1
        self.prompt_length = len(prompt)
        self.trie.insert(self.sequence, 0, len(prompt), from_prompt=True)
        self.counted = len(prompt)
        self.live_request = True

    def finish(self) -> None:
        self.pending, self.settled, self.surveyed, self.last_emitted = [], [], None, None
        if not self.live_request:
            return
        if self.shared:
            self.trie.end_prompt(self.sequence, self.prompt_length)
        else:
            self.trie.end_request()
        self.live_request = False

    def target_tree_sizes(self):
        return tuple(range(1, self.max_tree_size + 1))  # a retrieved tree has any size up to decoding_length

    def survey(self, root: int) -> int:
        """The longest draft the coming step could score (the trie's decoding length), retrieved before the step's
        rows are handed out (decoder/sharing.py) and followed in the shadow whatever part of it is scored; its
        size. `propose` then scores its first `decoding_length` nodes, `idle` none."""
        self._enter(root)
        tokens, parents = self.trie.retrieve(self.sequence, self.length + 1, self.max_tree_size)
        self.surveyed = (tokens.tolist(), parents.tolist())
        if len(tokens) > 1:
            self.pending.append(ShadowDraft(*self.surveyed, after=self.last_emitted))
        return len(tokens)

    def idle(self, root):
        self._enter(root)  # the trie still learns the text
        if self.surveyed is not None:  # its shadow is pending already
            self.surveyed = None
        elif self.decoding_length > 1:  # the draft this step would have scored, settled as the text goes on
            tokens, parents = self.trie.retrieve(self.sequence, self.length + 1, self.decoding_length)
            if len(tokens) > 1:
                self.pending.append(ShadowDraft(tokens.tolist(), parents.tolist()))
            else:  # settled already: one token, which counts where such a step rides a batch's drafted one
                self.settled.append(ShadowDraft([root], [-1]))
        return super().idle(root)

    def shadow_yields(self):
        settled, self.settled = self.settled, []
        return settled

    def _enter(self, root: int) -> None:
        self.sequence[self.length] = root
        if self.counted == self.length:  # a root the top level of a hierarchy chose: it enters the trie now
            self.trie.insert(self.sequence, self.length, self.length + 1)
            self.counted += 1

    def drafts_now(self) -> bool:
        return self.drafting and self.decoding_length > 1  # 1: the schedule's "off"

    def propose(self, root, params, draw, generator):
        if not self.drafts_now():
            return self.idle(root)
        self._enter(root)
        if self.surveyed is not None:
            (tokens, parents), self.surveyed = self.surveyed, None
            return DraftTree(tokens[:self.decoding_length], parents[:self.decoding_length])
        tokens, parents = self.trie.retrieve(self.sequence, self.length + 1, self.decoding_length)
        return DraftTree(tokens.tolist(), parents.tolist())

    def update(self, tree, accepted, next_token):
        if self.pending:
            self._settle([tree.tokens[v] for v in accepted[1:]] + ([] if next_token is None else [next_token]))
        self._commit([tree.tokens[v] for v in accepted])
        # Emitted tokens enter the trie at once, the next root included: this is what the offline replays
        # of planner/lookahead.py and `plan accept triforce` do, so that they stay exact.
        end = self.length
        if next_token is not None:
            self.sequence[end] = next_token
            end += 1
        self.trie.insert(self.sequence, self.counted, end)
        self.counted = end

    def _settle(self, emitted: list[int]) -> None:
        """The text's next tokens, `emitted`, walked down every pending shadow draft."""
        self.pending, settled = walk_shadows(self.pending, emitted)
        self.settled.extend(settled)
        if settled:
            self.last_emitted = settled[-1].emitted

    def committed_draft(self) -> ShadowDraft:
        """The draft it would retrieve now from the committed text, whose last token is the root (a hierarchy's
        bottom sitting a step out: decoder/triforce.py)."""
        tokens, parents = self.trie.retrieve(self.sequence, self.length, self.max_tree_size)
        return ShadowDraft(tokens.tolist(), parents.tolist())

    def extend(self, tokens):
        # Only a hierarchy calls this: re-committing chain tokens whose windows its rounds already counted, or the
        # root of a step it sat out, whose windows enter the trie now (they would at its next drafted step's first
        # round), so that what it drafts in the shadow of such steps, and first when it resumes, reads the text
        self._commit(tokens)
        if self.counted < self.length:
            self.trie.insert(self.sequence, self.counted, self.length)
            self.counted = self.length

    def _commit(self, tokens: list[int]) -> None:
        needed = self.length + len(tokens) + 1
        if needed > len(self.sequence):
            self.sequence = np.concatenate([self.sequence, np.zeros(needed, dtype=np.int64)])
        self.sequence[self.length:self.length + len(tokens)] = tokens
        self.length += len(tokens)

    def rollback(self, count):
        # The withdrawn tokens, and the rejected root after them, leave the trie: it holds the text alone.
        self.length -= count
        self.trie.withdraw(self.sequence, self.length, self.counted)
        self.counted = self.length
