"""CUDA graphs for the decoder's forwards on a GPU: one graph per static shape (number of new tokens, rounded
up to one of GRAPH_SIZES).

A graph replays fixed kernels on fixed memory, so every input lives in a static buffer: tokens, positions,
the cache slots the new keys go to (written with index_copy_), and an additive mask over all `max_len` cache
slots (the static layout of decoder/model.py). A Sequoia plan has few shapes (the verify size and each tree
level's width); Lookahead's trees and TriForce's middle level vary in size, and padded they share a few. The
graphs are captured once per cache (LeanModel.cache_for keeps a few across generations): those of the sizes a
drafter declares when the cache is made (SpeculativeEngine.prepare), others on first use. Greedy and sampled
decoding use the same graphs: only the logits come out of them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specplan.core.errors import UserError
from specplan.decoder.model import KVCache, LeanModel

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


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

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
                 logits_rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        n = tokens.shape[0]
        size = graph_size(n, cache.max_len - cache.length)
        # A forward over a cache that hands out its root's rotated queries (TriForce's top verify: the retrieval
        # cache's next selection) has a graph of its own that copies them out.
        graph, buffers = self._graph(cache, size, cache.root_queries is not None)
        device = self.model.device
        buffers["tokens"][:n].copy_(tokens.to(device, non_blocking=True))
        buffers["positions"][:n].copy_(positions.to(device, non_blocking=True))
        buffers["slots"].copy_(torch.arange(cache.length, cache.length + size, device=device))
        full_mask = buffers["mask"]
        full_mask.fill_(float("-inf"))
        if mask is None:
            full_mask[:n, :cache.length + n] = 0
        else:
            full_mask[:n, :mask.shape[1]].copy_(mask.to(device, non_blocking=True))
        # Padding rows (earlier tokens and positions, keys written past the n new ones, where nothing lives) see
        # every slot, so that no row is all -inf; their logits are never read.
        full_mask[n:, :cache.length + size] = 0
        graph.replay()
        if cache.root_queries is not None:
            cache.root_queries.copy_(buffers["queries"])
        logits = buffers["logits"][:n]
        return logits if logits_rows is None else logits[logits_rows]

    def capture(self, cache: KVCache, sizes: Iterable[int]) -> None:
        """Capture now, over an empty `cache`, the graphs that forwards of `sizes` tokens will replay."""
        for n in sizes:
            self._graph(cache, graph_size(n, cache.max_len - cache.length), cache.root_queries is not None)

    def _graph(self, cache: KVCache, n: int, hands_out_queries: bool):
        key = (n, hands_out_queries)
        if key not in cache.graphs:
            device, dtype, shape = self.model.device, self.model.dtype, self.model.shape
            # Warm-up and capture write their keys where this call's keys go next.
            buffers = {
                "tokens": torch.zeros(n, dtype=torch.long, device=device),
                "positions": torch.zeros(n, dtype=torch.long, device=device),
                "slots": torch.arange(cache.length, cache.length + n, device=device),
                "mask": torch.zeros(n, cache.max_len, dtype=dtype, device=device),
            }
            # the graph writes the root's queries into a buffer of its own (the cache's may change between replays)
            root_queries = cache.root_queries
            if hands_out_queries:
                buffers["queries"] = torch.zeros(shape.layers, shape.heads, shape.head_dim, dtype=dtype, device=device)
            cache.root_queries = buffers.get("queries")
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(self.warmup):
                        self.model.forward(buffers["tokens"], buffers["positions"], cache, buffers["mask"],
                                           slots=buffers["slots"])
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    buffers["logits"] = self.model.forward(buffers["tokens"], buffers["positions"], cache,
                                                           buffers["mask"], slots=buffers["slots"])
            finally:
                cache.root_queries = root_queries
            cache.graphs[key] = (graph, buffers)
        return cache.graphs[key]
