"""CUDA graphs for the decoder's forwards on a GPU: one graph per static shape (number of new tokens).

A graph replays fixed kernels on fixed memory, so every input lives in a static buffer: tokens, positions,
the cache slots the new keys go to (written with index_copy_), and an additive mask over all `max_len` cache
slots (the static layout of decoder/model.py). A Sequoia plan has few shapes (the verify size and each tree
level's width), so they are captured once per cache and replayed every step. Greedy and sampled decoding use
the same graphs: only the logits come out of them.
"""

from __future__ import annotations

import torch

from decoder.model import KVCache, LeanModel


class GraphedForward:
    """Drop-in for LeanModel.forward (dynamic layout) that replays a CUDA graph per (cache, n)."""

    def __init__(self, model: LeanModel, warmup: int = 2) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.warmup = warmup
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
                 logits_rows: torch.Tensor | slice | None = None, **unused) -> torch.Tensor:
        n = tokens.shape[0]
        graph, buffers = self._graph(cache, n)
        device = self.model.device
        buffers["tokens"].copy_(tokens.to(device, non_blocking=True))
        buffers["positions"].copy_(positions.to(device, non_blocking=True))
        buffers["slots"].copy_(torch.arange(cache.length, cache.length + n, device=device))
        full_mask = buffers["mask"]
        full_mask.fill_(float("-inf"))
        if mask is None:
            full_mask[:, :cache.length + n] = 0
        else:
            full_mask[:, :mask.shape[1]].copy_(mask.to(device, non_blocking=True))
        graph.replay()
        logits = buffers["logits"]
        return logits if logits_rows is None else logits[logits_rows]

    def _graph(self, cache: KVCache, n: int):
        key = (id(cache), n)
        if key not in self.graphs:
            device, dtype = self.model.device, self.model.dtype
            # Warm-up and capture write their keys into the cache's last n slots, which hold nothing yet.
            buffers = {
                "tokens": torch.zeros(n, dtype=torch.long, device=device),
                "positions": torch.zeros(n, dtype=torch.long, device=device),
                "slots": torch.arange(cache.max_len - n, cache.max_len, device=device),
                "mask": torch.zeros(n, cache.max_len, dtype=dtype, device=device),
            }
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
            self.graphs[key] = (graph, buffers)
        return self.graphs[key]
