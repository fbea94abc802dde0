"""SGLang's NGRAM speculative decoding, replayed step by step over the target's greedy outputs (SGLang 0.5.23,
read from its sources; each rule below names the file it follows).

One trie serves every request of the server, from its start (`Trie`, trie.cpp). After each verify step the worker
inserts the request's last `max_trie_depth` tokens *as they were before that step*: the tokens the step just
accepted are inserted after the next one (ngram_worker.py, `_update_ngram_corpus` runs inside the forward, before
the scheduler appends them to `output_ids`; in overlap mode it splices the previous round's tokens, to the same
effect). The prompt itself is never inserted, only its tail within those windows. An insert walks every suffix of
the window from the root, creating nodes, and moves every node it passes to the front of its parent's children:
children are kept most recently seen first.

Each step matches the context's suffixes of every length up to max_trie_depth in the trie (SGLang caches them per
request in a `MatchState` and advances them by the tokens appended since; as the trie only grows until its capacity
evicts, that equals matching afresh, which the replay does). From every matched node that has children, longest
match first, a breadth-first walk adds the children, most recent first, up to a breadth that starts at
(max_trie_depth - 1 - d) * scale + min_bfs_breadth for a match of d tokens (scale = (max_bfs_breadth -
min_bfs_breadth) / (max_trie_depth - 1)) and falls by scale per level, at least 1 child; walks from several matches
merge where their tokens agree, until num_draft_tokens - 1 nodes are placed. The
tree is padded to num_draft_tokens tokens with token 0 under the root, and the target verifies all of them: a step
always costs a forward of num_draft_tokens tokens. Greedy verification follows the child that equals the target's
own next token, plus one token of its own (verify_tree_greedy), so for greedy decoding the replay is exact.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from specplan.core.errors import UserError
from specplan.core.method_settings import NgramTreeSettings
from specplan.planner.engines import Source

SGLANG_VERSION = "v0.5.23"  # the PyPI release whose sources these rules were read from
SGLANG_TRIE = Source(
    "sgl-project/sglang", "python/sglang/kernels/jit/csrc/ngram_corpus/trie.cpp", SGLANG_VERSION,
    "Trie::insert (every suffix of the window, children most recent first), Trie::match (cached suffix matches "
    "advanced by the appended tokens), Trie::buildRecency (the breadth-first tree from the expandable matches)")
SGLANG_WORKER = Source(
    "sgl-project/sglang", "python/sglang/srt/speculative/ngram_worker.py", SGLANG_VERSION,
    "NGRAMWorker: the context is the last max_trie_depth tokens, the inserted window the same tokens before the "
    "step's own; every step verifies num_draft_tokens tokens (result.cpp fillResult pads with token 0)")
CAPACITY = 10_000_000  # --speculative-ngram-capacity's default: nodes before the trie evicts (not replayed)
PADDING_TOKEN = 0  # fillResult's padding, children of the root



class TrieNode:
    """A trie node: its children by token, in the order last seen (iterating from the end gives the most recent
    first), and how many inserted n-grams passed through it (PROB ranks children by it)."""

    __slots__ = ("children", "freq")

    def __init__(self) -> None:
        self.children: OrderedDict[int, TrieNode] = OrderedDict()
        self.freq = 1

    def by_frequency(self, count: int) -> list[tuple[int, TrieNode]]:
        """The `count` most frequent children, ties by token (TrieNode::CompareByFreq)."""
        return sorted(self.children.items(), key=lambda item: (-item[1].freq, item[0]))[:count]


class ProbabilityHeap:
    """std::priority_queue of (parent index, trie node, probability) ordered by probability alone, replayed with
    libstdc++'s push_heap and pop_heap, which decide among equal probabilities (bits/stl_heap.h)."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int, TrieNode, float]] = []  # (parent, token, node, probability)

    def push(self, item: tuple[int, int, TrieNode, float]) -> None:
        self.items.append(item)
        self._sift_up(len(self.items) - 1, 0, item)

    def pop(self) -> tuple[int, int, TrieNode, float]:
        items = self.items
        top = items[0]
        if len(items) > 1:
            last = len(items) - 1
            value, items[last] = items[last], items[0]
            self._adjust(0, last, value)
        items.pop()
        return top

    def _sift_up(self, hole: int, top: int, value: tuple) -> None:  # __push_heap
        items = self.items
        parent = (hole - 1) // 2
        while hole > top and items[parent][3] < value[3]:
            items[hole] = items[parent]
            hole, parent = parent, (parent - 1) // 2
        items[hole] = value

    def _adjust(self, hole: int, length: int, value: tuple) -> None:  # __adjust_heap
        items, top, child = self.items, hole, hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if items[child][3] < items[child - 1][3]:
                child -= 1
            items[hole], hole = items[child], child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            items[hole], hole = items[child - 1], child - 1
        self._sift_up(hole, top, value)


class NgramTreeProposer:
    """SGLang's NGRAM drafter and its greedy verification, one step at a time (see the module docstring)."""

    drafts_in_prefill = False  # the prefill samples the first token; drafting starts at the first decode step

    def __init__(self, settings: NgramTreeSettings) -> None:
        self.settings = settings
        self.root = TrieNode()
        self.nodes = 1

    def new_request(self) -> None:
        """The trie serves every request; nothing else is kept."""

    def step(self, sequence: np.ndarray, position: int) -> tuple[int, int]:
        """(tokens drafted, of them accepted) for the step after sequence[:position], whose greedy continuation is
        sequence[position:]; then the step's insert."""
        context = sequence[max(0, position - self.settings.max_trie_depth):position].tolist()
        tree = self.draft(context)
        drafted = self.settings.num_draft_tokens - 1
        accepted = self.accepted(tree, sequence[position:position + drafted].tolist())
        self.insert(context)
        return drafted, accepted

    def accepted(self, tree: list[dict[int, int]], truth: list[int]) -> int:
        """The draft tokens greedy verification accepts: the path of children equal to the target's tokens."""
        accepted, node = 0, 0
        for token in truth:
            child = tree[node].get(token)
            if child is None:
                padded = len(tree) <= self.settings.num_draft_tokens - 1
                return 1 if node == 0 and token == PADDING_TOKEN and padded else accepted
            accepted, node = accepted + 1, child
        return accepted

    def insert(self, window: list[int]) -> None:
        """Trie::insert: every suffix of the window, up to max_trie_depth tokens, from the root."""
        depth = self.settings.max_trie_depth
        for start in range(len(window)):
            cursor = self.root
            for token in window[start:start + depth]:
                child = cursor.children.get(token)
                if child is None:
                    child = cursor.children[token] = TrieNode()
                    self.nodes += 1
                else:
                    child.freq += 1
                    cursor.children.move_to_end(token)
                cursor = child
        if self.nodes > CAPACITY:
            raise UserError(f"the replay's trie outgrew SGLang's default capacity of {CAPACITY} nodes, beyond which "
                            "SGLang evicts (not replayed): replay fewer or shorter records")

    def _matches(self, context: list[int]) -> list[tuple[TrieNode, int]]:
        """The context's suffixes found in the trie that have children, longest first (Trie::match and
        getExpandableAnchors_)."""
        found = []
        for length in range(1, len(context) + 1):
            node: TrieNode | None = self.root
            for token in context[len(context) - length:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is None:
                break  # the trie holds every suffix of what it holds: no longer suffix is in it either
            if node.children:
                found.append((node, length))
        return found[::-1]

    def draft(self, context: list[int]) -> list[dict[int, int]]:
        """The tree after `context`, a request's last max_trie_depth tokens: tree[i] maps a token to its child's
        index; 0 is the root, the last token. Padding (token 0) is not in it."""
        tree: list[dict[int, int]] = [{}]
        if self.settings.match_type == "BFS":
            self._grow_by_recency(tree, self._matches(context))
        else:
            self._grow_by_frequency(tree, self._matches(context))
        return tree

    def _place(self, tree: list[dict[int, int]], parent: int, token: int) -> int:
        """The index of `token` under tree node `parent`, placed if new."""
        index = tree[parent].get(token)
        if index is None:
            index = tree[parent][token] = len(tree)
            tree.append({})
        return index

    def _grow_by_recency(self, tree: list[dict[int, int]], anchors: list[tuple[TrieNode, int]]) -> None:
        """Trie::buildRecency: from each match, breadth-first, the most recent children within the breadth."""
        s = self.settings
        deepest = max(1, s.max_trie_depth - 1)
        scale = (s.max_bfs_breadth - s.min_bfs_breadth) / deepest
        budget = s.num_draft_tokens - 1
        for anchor, length in anchors:
            queue = deque([(0, (deepest - length) * scale + s.min_bfs_breadth, anchor)])
            while queue and len(tree) <= budget:
                parent, breadth, node = queue.popleft()
                for taken, (token, child) in enumerate(reversed(node.children.items())):
                    if taken >= max(1, int(breadth)) or len(tree) > budget:
                        break
                    queue.append((self._place(tree, parent, token), breadth - scale, child))

    def _grow_by_frequency(self, tree: list[dict[int, int]], anchors: list[tuple[TrieNode, int]]) -> None:
        """Trie::buildFrequency: from each match, the most probable continuations first, a node's probability its
        parent's times its share of the max_bfs_breadth most frequent siblings' counts (one heap for all matches)."""
        budget, breadth = self.settings.num_draft_tokens - 1, self.settings.max_bfs_breadth
        heap = ProbabilityHeap()

        def expand(parent: int, node: TrieNode, probability: float) -> None:
            children = node.by_frequency(breadth)
            total = float(sum(child.freq for _, child in children)) or 1.0
            for token, child in children:
                heap.push((parent, token, child, child.freq / total * probability))

        for anchor, _ in anchors:
            expand(0, anchor, 1.0)
            while heap.items and len(tree) <= budget:
                parent, token, node, probability = heap.pop()
                expand(self._place(tree, parent, token), node, probability)

def token_paths(tree: list[dict[int, int]]) -> set[tuple[int, ...]]:
    """Every node of a drafted tree (`NgramTreeProposer.draft`) as its tokens from the root: the tree as SGLang's
    tokens and mask also give it, whatever the order of siblings."""
    paths, stack = set(), [(0, ())]
    while stack:
        index, path = stack.pop()
        for token, child in tree[index].items():
            paths.add(path + (token,))
            stack.append((child, path + (token,)))
    return paths
