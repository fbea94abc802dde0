"""Prefixes kept in host memory across a server's slots (llama-server's `--cache-ram`, vLLM's prefix caching).

A slot's cache keeps what its last sequence left (KVCache.held), which its next request reuses where their tokens
agree. When that next request shares less than half of it, the slot's prefix is saved here before it is overwritten;
a request whose prompt shares more with a saved prefix than with its slot's own starts from a copy of the saved keys
and values instead (the same tokens at the same positions: the values a prefill would compute). Saved prefixes are
dropped least recently used first beyond the memory budget. They share their heads, as SGLang's radix cache does: one
that begins as a saved one does (the slots of a wave of questions over one document) keeps only its own tail and reads
the rest from that one, which stays while anything reads from it. A sequence in flight is a source too: a joining
request whose prompt shares a long prefix with one running or prefilling (questions over one document, sent at once)
copies that prefix from its cache instead of computing it again (`copy_prefix`; decoder/batching.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specplan.core.choices import MIN_SAVED_TOKENS
from specplan.decoder.model import KVCache


def shared_prefix(tokens: np.ndarray, prompt: np.ndarray) -> int:
    """How many leading ids the two agree on."""
    length = min(len(tokens), len(prompt))
    differ = np.flatnonzero(tokens[:length] != prompt[:length])
    return int(differ[0]) if len(differ) else length


def copy_prefix(source: KVCache, cache: KVCache, count: int) -> None:
    """`cache` to hold the first `count` slots of `source` (the same tokens at the same positions: the keys and values
    a prefill would compute), beyond the prefix it holds already."""
    start = cache.length
    cache.k[:, :, start:count] = source.k[:, :, start:count]
    cache.v[:, :, start:count] = source.v[:, :, start:count]
    cache.length = count


@dataclass(eq=False)  # entries are told apart by identity
class SavedPrefix:
    """Saved tokens with the keys and values of `tokens[start:]`; those of `tokens[:start]` are its parent's."""

    tokens: np.ndarray  # [n] int64
    keys: torch.Tensor  # [layers, kv_heads, n - start, head_dim]
    values: torch.Tensor  # [layers, kv_heads, n - start, head_dim]
    parent: SavedPrefix | None = None
    start: int = 0
    children: int = 0  # saved prefixes reading their heads from this one

    @property
    def bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def lineage(self) -> list[SavedPrefix]:
        """This prefix and the ones it reads from, itself first."""
        chain = [self]
        while chain[-1].parent is not None:
            chain.append(chain[-1].parent)
        return chain

    def copy_into(self, cache: KVCache, count: int) -> None:
        """Its first `count` slots into `cache`: each part from the prefix that holds it."""
        end = count
        for entry in self.lineage():
            if entry.start < end:
                cache.k[:, :, entry.start:end] = entry.keys[:, :, :end - entry.start]
                cache.v[:, :, entry.start:end] = entry.values[:, :, :end - entry.start]
                end = entry.start


class PromptCache:
    """Saved prefixes, least recently used first out beyond `budget_bytes` (a prefix others read from after them)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: list[SavedPrefix] = []  # least recently used first
        self.bytes = 0

    def reuse(self, cache: KVCache, prompt: list[int]) -> None:
        """Ready a slot's `cache` for `prompt` (before KVCache.keep_prefix): save what it holds if the prompt keeps
        less than half of it, and load the saved prefix sharing the most with the prompt where that beats the slot's
        own."""
        if cache.key_positions is not None:  # slots are not positions: KVCache.keep_prefix keeps nothing either
            return
        wanted = np.asarray(prompt[:-1], dtype=np.int64)
        held = np.asarray(cache.held[:cache.length] if cache.held is not None else [], dtype=np.int64)
        own = shared_prefix(held, wanted)
        best, best_shared = None, own
        for entry in self.entries:
            shared = shared_prefix(entry.tokens, wanted)
            if shared > best_shared:
                best, best_shared = entry, shared
        count = 0 if best is None else min(len(best.tokens), cache.max_len)
        kept = own if best is None else shared_prefix(held, best.tokens[:count])
        if best is not None:
            self._touch(best)  # before the save makes room, least recently used first
        if len(held) >= MIN_SAVED_TOKENS and 2 * kept < len(held):
            self._save(cache, held)
        if best is None:
            return
        best.copy_into(cache, count)
        cache.held, cache.length = best.tokens[:count].tolist(), count

    def _save(self, cache: KVCache, held: np.ndarray) -> None:
        shares = [(shared_prefix(entry.tokens, held), entry) for entry in self.entries]
        if any(shared == len(held) for shared, _ in shares):
            return  # a saved prefix already holds these tokens
        start, parent = max(shares, key=lambda pair: pair[0], default=(0, None))
        while parent is not None and parent.start >= start:  # its own part holds none of the shared tokens
            parent = parent.parent
        if start < MIN_SAVED_TOKENS:
            start, parent = 0, None
        entry = SavedPrefix(held, cache.k[:, :, start:len(held)].clone(), cache.v[:, :, start:len(held)].clone(),
                            parent, start)
        if entry.bytes > self.budget_bytes:
            return
        if parent is not None:
            parent.children += 1
            self._touch(parent)
        self.entries.append(entry)
        self.bytes += entry.bytes
        while self.bytes > self.budget_bytes:
            self._drop(next(e for e in self.entries if e.children == 0))

    def _touch(self, entry: SavedPrefix) -> None:
        """`entry` and the prefixes it reads from, the most recently used."""
        for used in reversed(entry.lineage()):
            self.entries.remove(used)
            self.entries.append(used)

    def _drop(self, entry: SavedPrefix) -> None:
        self.entries.remove(entry)
        self.bytes -= entry.bytes
        if entry.parent is not None:
            entry.parent.children -= 1
