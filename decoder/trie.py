"""Lookahead's token trie: n-gram branches of the prompt and of the output, merged into draft token trees.

Flat arrays, numba-compiled; node 0 is the root. A node's weight is
    output_count + prompt_weight * prompt_count
where output_count counts the windows of generated text through the node (across requests, decayed at
capacity) and prompt_count the windows of the current prompt (eliminated when the request ends).
Windows are `window` tokens long: every position of a sequence starts one, so a node at depth k below a
matched context of j tokens holds the continuations seen after that context.

Retrieval is multi-stage: the longest context suffix (up to `max_prefix` tokens) that matches is used first,
then shorter ones while the draft has room, and from each matched node the heaviest nodes are taken
best-first (a node is taken only after its parent) down to `branch_length` tokens below the root; branches
sharing a prefix are merged into one tree of at most `decoding_length` tokens, root included.

Pruning: when the trie holds more than `capacity` nodes beyond those of the live prompt's branches, output
counts are halved and nodes with no prompt count and an output count below 1 are removed (with their
subtrees) until it fits; prompt branches stay while their request is live.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from specplan.core.method_settings import TrieSettings

_EMPTY = -1
# A node's children are found through an open-addressing table of (parent, token) keys in two arrays of the state,
# not a numba typed Dict: a compiled call's dispatch types each argument in Python, a typed Dict slowly, and a
# decoder's trie calls come right after a forward has swept the caches, where that typing cost more than the call's
# own work (docs/benchmark-log.md: "Where a sitting-out plan's time goes"). The table is at least twice the node
# slots: probes stay short.
_TABLE_LOAD = 2
_HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # Fibonacci hashing: the key times 2^64 / golden ratio, bits 32 up the slot


def accepted_run(draft_tokens: np.ndarray, draft_parents: np.ndarray, wanted: np.ndarray) -> int:
    """Draft tokens a greedy verifier accepts when it picks `wanted` in turn: follow the children holding them."""
    node, accepted = 0, 0
    while accepted < len(wanted):
        child = next((c for c in range(node + 1, len(draft_tokens))
                      if draft_parents[c] == node and draft_tokens[c] == wanted[accepted]), None)
        if child is None:
            break
        node, accepted = child, accepted + 1
    return accepted


@njit(cache=True)
def _key(parent: int, token: int) -> int:
    return parent * 4294967296 + token


@njit(cache=True)
def _slot(child_keys, key: int) -> int:
    """Where `key` is in the table, or the free entry where it would go (linear probing from its hash)."""
    mask = child_keys.shape[0] - 1
    slot = (np.uint64(key) * np.uint64(_HASH_MULTIPLIER)) >> np.uint64(32)
    slot = np.int64(slot) & mask
    while child_keys[slot] != key and child_keys[slot] != _EMPTY:
        slot = (slot + 1) & mask
    return slot


@njit(cache=True)
def _child(state, parent: int, token: int) -> int:
    key = _key(parent, token)
    slot = _slot(state.child_keys, key)
    if state.child_keys[slot] == key:
        return state.child_nodes[slot]
    return _EMPTY


class TrieArrays(NamedTuple):
    """The trie's nodes as flat arrays (numba reads a NamedTuple by field); slots beyond `size[0]` are free."""

    tokens: np.ndarray  # [slots] int64: the node's token
    parents: np.ndarray  # [slots] int64
    first_child: np.ndarray  # [slots] int64, _EMPTY for a leaf
    next_sibling: np.ndarray  # [slots] int64, _EMPTY for the last sibling
    output_count: np.ndarray  # [slots] float64: windows of generated text through the node (decayed)
    prompt_count: np.ndarray  # [slots] float64: windows of the live prompt through the node
    size: np.ndarray  # [1] int64: nodes in use (an array, so that compiled code can grow it)
    child_keys: np.ndarray  # [table] int64: a child's _key(parent, token), _EMPTY for a free entry
    child_nodes: np.ndarray  # [table] int64: that child


@njit(cache=True)
def _add_child(state, parent: int, token: int) -> int:
    tokens, parents, first_child, next_sibling, output_count, prompt_count, size, child_keys, child_nodes = state
    node = size[0]
    tokens[node] = token
    parents[node] = parent
    first_child[node] = _EMPTY
    next_sibling[node] = first_child[parent]
    first_child[parent] = node
    output_count[node] = 0.0
    prompt_count[node] = 0.0
    key = _key(parent, token)
    slot = _slot(child_keys, key)
    child_keys[slot] = key
    child_nodes[slot] = node
    size[0] = node + 1
    return node


@njit(cache=True)
def _count_windows(state, sequence, old_length, new_length, window, from_prompt, delta):
    """Add `delta` to the counts of the windows of sequence[:new_length] that gained tokens since old_length
    (the arrays must have room for (new_length - old_length + window) * window new nodes). A negative delta
    withdraws an earlier insertion of the same tokens: it creates no nodes and stops at pruned ones."""
    counts = state.prompt_count if from_prompt else state.output_count
    for start in range(max(0, old_length - window + 1), new_length):
        node = 0
        end = min(start + window, new_length)
        done = min(start + window, old_length)  # tokens of this window counted before
        for position in range(start, end):
            token = sequence[position]
            nxt = _child(state, node, token)
            if nxt == _EMPTY:
                if delta < 0:
                    break
                nxt = _add_child(state, node, token)
            node = nxt
            if position >= done:
                counts[node] = max(counts[node] + delta, 0.0)


@njit(cache=True)
def _match(state, sequence, length, prefix_length):
    node = 0
    for position in range(length - prefix_length, length):
        node = _child(state, node, sequence[position])
        if node == _EMPTY:
            return _EMPTY
    return node


@njit(cache=True)
def _retrieve(state, sequence, length, decoding_length, branch_length, max_prefix, prompt_weight,
              draft_tokens, draft_parents):
    """Fill draft_tokens/draft_parents (node 0 = the root, sequence[length-1]); returns the draft size."""
    tokens, parents, first_child, next_sibling, output_count, prompt_count, size, _, _ = state
    draft_tokens[0] = sequence[length - 1]
    draft_parents[0] = -1
    count = 1
    for prefix_length in range(min(max_prefix, length), 0, -1):
        if count >= decoding_length:
            break
        matched = _match(state, sequence, length, prefix_length)
        if matched == _EMPTY:
            continue
        # Best-first over the subtree below `matched`; heap entries (-weight, depth, trie node, draft parent).
        heap = [(0.0, 0, 0, 0)]
        heap.pop()
        child = first_child[matched]
        while child != _EMPTY:
            heap.append((-(output_count[child] + prompt_weight * prompt_count[child]), 1, child, 0))
            child = next_sibling[child]
        _heapify(heap)
        while heap and count < decoding_length:
            negative_weight, depth, node, draft_parent = _heappop(heap)
            token = tokens[node]
            # Merge with an existing draft child holding the same token (shared prefixes).
            existing = -1
            for d in range(1, count):
                if draft_parents[d] == draft_parent and draft_tokens[d] == token:
                    existing = d
                    break
            if existing == -1:
                existing = count
                draft_tokens[count] = token
                draft_parents[count] = draft_parent
                count += 1
            if depth < branch_length:
                child = first_child[node]
                while child != _EMPTY:
                    _heappush(heap, (-(output_count[child] + prompt_weight * prompt_count[child]), depth + 1,
                                     child, existing))
                    child = next_sibling[child]
    return count


@njit(cache=True)
def _heapify(heap):
    for i in range(len(heap) // 2 - 1, -1, -1):
        _sift_down(heap, i)


@njit(cache=True)
def _sift_down(heap, i):
    n = len(heap)
    while True:
        smallest = i
        left, right = 2 * i + 1, 2 * i + 2
        if left < n and heap[left] < heap[smallest]:
            smallest = left
        if right < n and heap[right] < heap[smallest]:
            smallest = right
        if smallest == i:
            return
        heap[i], heap[smallest] = heap[smallest], heap[i]
        i = smallest


@njit(cache=True)
def _heappush(heap, item):
    heap.append(item)
    i = len(heap) - 1
    while i > 0:
        parent = (i - 1) // 2
        if heap[i] < heap[parent]:
            heap[i], heap[parent] = heap[parent], heap[i]
            i = parent
        else:
            return


@njit(cache=True)
def _heappop(heap):
    last = heap.pop()
    if not heap:
        return last
    top = heap[0]
    heap[0] = last
    _sift_down(heap, 0)
    return top


@njit(cache=True)
def _surviving(state, decay, drop_prompt):
    """Decay output counts (and forget prompt counts if asked); mark the nodes that stay (parents first)."""
    tokens, parents, first_child, next_sibling, output_count, prompt_count, size, _, _ = state
    n = size[0]
    keep = np.zeros(n, dtype=np.bool_)
    keep[0] = True
    for node in range(1, n):
        output_count[node] *= decay
        if drop_prompt:
            prompt_count[node] = 0.0
        keep[node] = keep[parents[node]] and (prompt_count[node] > 0.0 or output_count[node] >= 1.0)
    return keep


class Trie:
    def __init__(self, settings: TrieSettings) -> None:
        self.settings = settings.check()
        self.prompt_floor = 0  # nodes of the live prompt's branches: capacity counts the nodes beyond them
        self._allocate(max(1024, 2 * settings.capacity))
        self.draft_tokens = np.zeros(settings.decoding_length, dtype=np.int64)
        self.draft_parents = np.zeros(settings.decoding_length, dtype=np.int64)

    def _allocate(self, slots: int) -> None:
        table = 1 << int(_TABLE_LOAD * slots - 1).bit_length()  # a power of two, at least _TABLE_LOAD x the slots
        self.state = TrieArrays(np.zeros(slots, np.int64), np.full(slots, -1, np.int64),
                                np.full(slots, -1, np.int64), np.full(slots, -1, np.int64), np.zeros(slots),
                                np.zeros(slots), np.ones(1, np.int64), np.full(table, _EMPTY, np.int64),
                                np.zeros(table, np.int64))

    @property
    def size(self) -> int:
        return int(self.state.size[0])

    def insert(self, sequence: np.ndarray, old_length: int, new_length: int, from_prompt: bool = False) -> None:
        """Count the windows of sequence[:new_length] that grew since old_length (0 for a fresh sequence)."""
        window = self.settings.window
        needed = (new_length - max(0, old_length - window + 1)) * window
        if len(self.state.tokens) - self.size < needed:
            self._rebuild(np.ones(self.size, dtype=bool), room=needed)
        _count_windows(self.state, sequence, old_length, new_length, window, from_prompt, 1.0)
        if from_prompt:
            self.prompt_floor = self.size
        elif self.size > self.prompt_floor + self.settings.capacity:
            self.prune()

    def withdraw(self, sequence: np.ndarray, old_length: int, new_length: int) -> None:
        """Undo `insert(sequence, old_length, new_length)` of output tokens that turned out not to be the text
        (a hierarchy's bottom follows its middle level's tokens before the top verifies them)."""
        _count_windows(self.state, sequence, old_length, new_length, self.settings.window, False, -1.0)

    def retrieve(self, sequence: np.ndarray, length: int, decoding_length: int | None = None,
                 branch_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        s = self.settings
        if decoding_length is not None and not 1 <= decoding_length <= s.decoding_length:
            # the draft buffers hold the settings' decoding length (the compiled retrieval does not check its writes)
            raise ValueError(f"a draft of {decoding_length} nodes from a trie of decoding length {s.decoding_length}")
        count = _retrieve(self.state, sequence, length, decoding_length or s.decoding_length,
                          branch_length or s.branch_length, s.max_prefix, s.prompt_weight,
                          self.draft_tokens, self.draft_parents)
        return self.draft_tokens[:count], self.draft_parents[:count]

    def prune(self) -> None:
        while self.size > self.prompt_floor + self.settings.capacity:
            before = self.size
            self._rebuild(_surviving(self.state, 0.5, False))
            if self.size == before:
                break

    def end_request(self) -> None:
        """Branch eliminating: forget the finished prompt's branches."""
        self._rebuild(_surviving(self.state, 1.0, True))
        self.prompt_floor = 0

    def end_prompt(self, sequence: np.ndarray, length: int) -> None:
        """Branch eliminating in a trie shared by requests in flight: withdraw one finished prompt's windows
        (sequence[:length]), keeping the other live prompts' branches."""
        _count_windows(self.state, sequence, 0, length, self.settings.window, True, -1.0)
        self._rebuild(_surviving(self.state, 1.0, False))
        self.prompt_floor = int(np.count_nonzero(self.state.prompt_count[:self.size] > 0))

    def _rebuild(self, keep: np.ndarray, room: int = 0) -> None:
        """Copy the kept nodes (parents always precede children) into fresh arrays with `room` to spare."""
        tokens, parents, _, _, output_count, prompt_count, _, _, _ = self.state
        old_ids = np.nonzero(keep)[0]
        self._allocate(max(1024, 2 * self.settings.capacity, 2 * (len(old_ids) + room)))
        _copy_nodes(self.state, old_ids, tokens, parents, output_count, prompt_count)


@njit(cache=True)
def _copy_nodes(state, old_ids, tokens, parents, output_count, prompt_count):
    new_id = np.full(tokens.shape[0], -1, dtype=np.int64)
    new_id[0] = 0
    for i in range(1, old_ids.shape[0]):
        old = old_ids[i]
        node = _add_child(state, new_id[parents[old]], tokens[old])
        new_id[old] = node
        state.output_count[node] = output_count[old]
        state.prompt_count[node] = prompt_count[old]
