"""CUDA graphs for the decoder's forwards on a GPU: one graph per static shape (number of new tokens, rounded
up to one of GRAPH_SIZES); for a batch of sequences (continuous batching), one per (the sequences' caches, rows per
sequence rounded up the same way).

A graph replays fixed kernels on fixed memory, so every input lives in a static buffer: tokens, positions,
the cache slots the new keys go to (written with index_copy_), and an additive mask over all `max_len` cache
slots (the static layout of decoder/model.py). A Sequoia plan has few shapes (the verify size and each tree
level's width); Lookahead's trees and TriForce's middle level vary in size, and padded they share a few. The
graphs are captured once per cache (LeanModel.cache_for keeps a few across generations): those of the sizes a
drafter declares when the cache is made (SpeculativeEngine.prepare), others on first use. Greedy and sampled
decoding use the same graphs: only the logits come out of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from specplan.core.errors import UserError
from specplan.decoder.model import ForwardItem, KVCache, LeanModel

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Batched graphs kept, least recently used first out: each holds its caches' memory and its own activations. A
# server's batches are few (every slot in flight, then the batch draining as the last requests finish); a `--batches`
# profile interleaves up to about 30 (B, n) points per context over two contexts.
KEPT_BATCH_GRAPHS = 64


def graph_size(n: int, room: int) -> int:
    """The token count of the graph that scores n tokens: n rounded up to GRAPH_SIZES, so that trees of varying
    sizes (Lookahead's, TriForce's middle level) replay a few graphs instead of capturing one per size; n
    itself where the cache has fewer than that many free slots (`room`)."""
    size = next((s for s in GRAPH_SIZES if s >= n), n)
    return size if size <= room else n


def enable_cuda_graphs(model: LeanModel) -> None:
    """Replay every forward of `model` of a given size as a CUDA graph (GPU only). A model whose RoPE depends on
    the prompt's length (dynamic NTK, longrope) runs eagerly: a graph would keep the length it was captured with."""
    if not model.position_dependent_rope:
        model.graphed = GraphedForward(model)


def compile_forward(model: LeanModel) -> None:
    """Run the static-layout forward (the one the graphs capture) through torch.compile, which fuses each
    layer's elementwise operators (norms, RoPE, residual adds, the gated activation) into a few Triton kernels:
    under a graph every operator is still a kernel, about 2,000 per forward of smollm2-135m, and a small model is
    bound by their count, not by its weights (bench/gpu_forward.py). Each new shape is compiled once, before
    its graph is captured; the default mode, since the graphs here are this decoder's own."""
    if model.device.type != "cuda" or model.position_dependent_rope:
        raise UserError(f"the compiled backend runs under CUDA graphs, on a GPU, for a RoPE that does not depend on "
                        f"the prompt's length ({'this one does' if model.position_dependent_rope else 'no GPU'})")
    model.compiled_forward = torch.compile(model._forward)
    model.backend = "compiled"


class GraphedForward:
    """Drop-in for LeanModel.forward (dynamic layout) that replays a CUDA graph per (cache, graph_size(n), whether
    it hands out the root's queries).

    The graphs are kept on the cache (KVCache.graphs), whose memory they read and write: a graph must not
    outlive it, nor be looked up by an id() that a later cache can reuse."""

    def __init__(self, model: LeanModel, warmup: int = 2) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.warmup = warmup
        # the batched forwards' graphs (`many`), by (their caches in order, rows per sequence); each entry keeps
        # its caches alive, so that no other cache takes their memory (or their id()) while it may replay
        self.batch_graphs: OrderedDict[tuple, tuple] = OrderedDict()

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
                 logits_rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        item = ForwardItem(tokens, positions, cache, mask, logits_rows)
        size = graph_size(tokens.shape[0], cache.max_len - cache.length)
        # A forward over a cache that hands out its root's rotated queries (TriForce's top verify: the retrieval
        # cache's next selection) has a graph of its own that copies them out.
        graph, buffers = self._graph(cache, size, cache.root_queries is not None)
        stage_batch(buffers, [item], size)
        graph.replay()
        if cache.root_queries is not None:
            cache.root_queries.copy_(buffers["queries"])
        return batch_logits(buffers["logits"], [item], size)[0]

    def takes(self, items: list[ForwardItem]) -> bool:
        """Whether `many` replays these items' forward: caches in device memory whose slots are positions and that
        hand out no queries (TriForce's caches and a host cache run eagerly)."""
        return all(item.cache.key_positions is None and item.cache.root_queries is None and item.cache.stream is None
                   for item in items)

    def many(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """LeanModel.forward_many as a CUDA graph: every sequence's rows padded to one count (graph_size of the
        largest, within every cache's room), one graph per (caches, that count). Logits per item, as forward
        returns them."""
        caches = [item.cache for item in items]
        rows = graph_size(max(item.tokens.shape[0] for item in items),
                          min(cache.max_len - cache.length for cache in caches))
        graph, buffers = self._batch_graph(caches, rows)
        stage_batch(buffers, items, rows)
        graph.replay()
        return batch_logits(buffers["logits"], items, rows)

    def _batch_graph(self, caches: list[KVCache], rows: int):
        key = (tuple(id(cache) for cache in caches), rows)
        if key in self.batch_graphs:
            self.batch_graphs.move_to_end(key)
            return self.batch_graphs[key][1:]
        buffers = batch_buffers(caches, rows, self.model.device, self.model.dtype)
        static = static_items(buffers, caches, rows)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self.model._forward_operators(static, buffers["slots"])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            buffers["logits"] = torch.cat(self.model._forward_operators(static, buffers["slots"]))
        self.batch_graphs[key] = (caches, graph, buffers)
        while len(self.batch_graphs) > KEPT_BATCH_GRAPHS:
            self.batch_graphs.popitem(last=False)
        return graph, buffers

    def capture(self, cache: KVCache, sizes: Iterable[int]) -> None:
        """Capture now, over an empty `cache`, the graphs that forwards of `sizes` tokens will replay."""
        for n in sizes:
            self._graph(cache, graph_size(n, cache.max_len - cache.length), cache.root_queries is not None)

    def _graph(self, cache: KVCache, n: int, hands_out_queries: bool):
        key = (n, hands_out_queries)
        if key not in cache.graphs:
            shape = self.model.shape
            # Warm-up and capture write their keys where this call's keys go next.
            buffers = batch_buffers([cache], n, self.model.device, self.model.dtype)
            (static,) = static_items(buffers, [cache], n)
            # the graph writes the root's queries into a buffer of its own (the cache's may change between replays)
            root_queries = cache.root_queries
            if hands_out_queries:
                buffers["queries"] = torch.zeros(shape.layers, shape.heads, shape.head_dim, dtype=self.model.dtype,
                                                 device=self.model.device)
            cache.root_queries = buffers.get("queries")
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(self.warmup):
                        self.model.forward(*static, slots=buffers["slots"][0])
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    buffers["logits"] = self.model.forward(*static, slots=buffers["slots"][0])
            finally:
                cache.root_queries = root_queries
            cache.graphs[key] = (graph, buffers)
        return cache.graphs[key]


def batch_buffers(caches: list[KVCache], rows: int, device: torch.device, dtype: torch.dtype) -> dict:
    """The static inputs of a batched graph: `rows` tokens and positions per sequence (flat, [len(caches) * rows]),
    per sequence the cache slots its rows write ([rows]) and its additive mask over all its cache's slots ([rows,
    max_len])."""
    count = len(caches)
    return {
        "tokens": torch.zeros(count * rows, dtype=torch.long, device=device),
        "positions": torch.zeros(count * rows, dtype=torch.long, device=device),
        "slots": [torch.arange(cache.length, cache.length + rows, device=device) for cache in caches],
        "masks": [torch.zeros(rows, cache.max_len, dtype=dtype, device=device) for cache in caches],
    }


def static_items(buffers: dict, caches: list[KVCache], rows: int) -> list[ForwardItem]:
    """The items a batched graph captures: views of its buffers."""
    return [ForwardItem(buffers["tokens"][b * rows:(b + 1) * rows], buffers["positions"][b * rows:(b + 1) * rows],
                        cache, buffers["masks"][b]) for b, cache in enumerate(caches)]


def stage_batch(buffers: dict, items: list[ForwardItem], rows: int) -> None:
    """Copy a step's items into a batched graph's buffers: each sequence's n rows first, then padding rows (earlier
    tokens, keys written past its n new ones, where nothing lives) that see every slot up to theirs, so that no
    row is all -inf; their logits are never read."""
    for b, item in enumerate(items):
        n, length = item.tokens.shape[0], item.cache.length
        own = slice(b * rows, b * rows + n)
        device = buffers["tokens"].device
        buffers["tokens"][own].copy_(item.tokens.to(device, non_blocking=True))
        buffers["positions"][own].copy_(item.positions.to(device, non_blocking=True))
        buffers["slots"][b].copy_(torch.arange(length, length + rows, device=device))
        mask = buffers["masks"][b]
        mask.fill_(float("-inf"))
        if item.mask is None:
            mask[:n, :length + n] = 0
        else:
            mask[:n, :item.mask.shape[1]].copy_(item.mask.to(device, non_blocking=True))
        mask[n:, :length + rows] = 0


def batch_logits(logits: torch.Tensor, items: list[ForwardItem], rows: int) -> list[torch.Tensor]:
    """Each item's logits out of a batched forward's [len(items) * rows, vocab]."""
    scored = []
    for b, item in enumerate(items):
        own = logits[b * rows:b * rows + item.tokens.shape[0]]
        scored.append(own if item.logits_rows is None else own[item.logits_rows])
    return scored
