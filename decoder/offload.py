"""A target whose layers, or whose KV cache, do not fit the device: they stay in host memory and stream in, layer by
layer, every forward (`plan generate --offload weights|kv`; the layouts profiler/offload.py models).

Weights: the layers past `resident` stay in host memory.

STREAM_BUFFERS device buffers shaped like one layer take the streamed layers in turn. On a GPU the copies run on a
side stream from pinned host memory: the first ones are issued before the resident layers compute, a layer's kernels
wait for its copy's event, and the copy of the layer STREAM_BUFFERS further on waits for those kernels before it
overwrites their buffer, so the link and the compute overlap. On a CPU (host and device both CPU) the same order runs
with plain copies, which is what the tests check: every forward copies each streamed layer once, into the buffer
its turn gives it, and computes exactly what the resident model computes. CUDA graphs are not captured for such a
model: a forward is bound by the link, and its copies are not part of a graph.

KV cache (a KVCache in host memory with a KVStream: the target's cache; a TriForce plan's retrieval cache stays on
the device): every layer's keys and values live in host memory. A forward copies layer i's cached rows into a device
buffer (the same turns and events as the weights), writes the new tokens' rows both into that buffer and back to host
memory, and attends over the buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from specplan.core.errors import UserError

STREAM_BUFFERS = 2  # double buffering: one buffer fills while the layer in the other computes
# What a GPU keeps beside the weights and the caches: the CUDA context with PyTorch's kernels loaded (about half a
# gigabyte), cuBLAS workspaces and one forward's activations.
DEVICE_RESERVE_BYTES = 1.0e9


class LayerStream:
    """Yields a model's layers in order, the resident ones as they are and the streamed ones copied into buffers."""

    def __init__(self, layers: list[dict[str, Any]], resident: int, device: torch.device) -> None:
        if not 0 <= resident <= len(layers):
            raise UserError(f"--resident-layers must be between 0 and the model's {len(layers)} layers")
        self.device = device
        self.resident = layers[:resident]
        cuda = device.type == "cuda"
        self.host = [{name: _host(weight, cuda) for name, weight in layer.items()} for layer in layers[resident:]]
        self.buffers = [{name: _like(weight, device) for name, weight in self.host[0].items()}
                        for _ in range(min(STREAM_BUFFERS, len(self.host)))] if self.host else []
        self.copy_stream = torch.cuda.Stream(device) if cuda and self.host else None
        self.copied_layers = 0  # streamed layers copied since the model was built (tests, and the bench)

    @property
    def streamed_bytes(self) -> int:
        """What one forward brings over the host link."""
        return sum(weight.numel() * weight.element_size() for layer in self.host for weight in layer.values()
                   if isinstance(weight, torch.Tensor))

    def layers(self) -> Iterator[dict[str, Any]]:
        """The forward's layers in order; a streamed layer's buffer is refilled once the layer has been computed (the
        caller has enqueued its work by the time it asks for the next layer)."""
        arrivals = {j: self._copy(j) for j in range(len(self.buffers))}
        yield from self.resident
        for j in range(len(self.host)):
            wait(arrivals.pop(j))
            yield self.buffers[j % len(self.buffers)]
            if j + len(self.buffers) < len(self.host):
                arrivals[j + len(self.buffers)] = self._copy(j + len(self.buffers))

    def _copy(self, j: int) -> torch.cuda.Event | None:
        """Copy streamed layer j into its buffer, after the work already enqueued (that buffer's last layer)."""
        buffer = self.buffers[j % len(self.buffers)]
        self.copied_layers += 1
        if self.copy_stream is None:
            for name, weight in self.host[j].items():
                if isinstance(weight, torch.Tensor):
                    buffer[name].copy_(weight)
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for name, weight in self.host[j].items():
                if isinstance(weight, torch.Tensor):
                    buffer[name].copy_(weight, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.copy_stream)
        return arrived



def _host(weight: Any, pin: bool) -> Any:
    """A layer's weight in host memory (pinned for asynchronous copies to a GPU)."""
    if not isinstance(weight, torch.Tensor):
        if weight is not None and not isinstance(weight, (int, float)):
            raise UserError("offloaded layers run on PyTorch's operators; this model's weights are in another form")
        return weight
    host = weight.detach().to("cpu")
    return host.pin_memory() if pin else host


def _like(weight: Any, device: torch.device) -> Any:
    return torch.empty_like(weight, device=device) if isinstance(weight, torch.Tensor) else weight


class KVStream:
    """Device buffers taking a host cache's layers in turn: begin() before the first layer, layer(i) for each."""

    def __init__(self, layers: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.device, self.layers = device, layers
        size = (kv_heads, max_len, head_dim)
        self.buffers = [(torch.empty(size, dtype=dtype, device=device), torch.empty(size, dtype=dtype, device=device))
                        for _ in range(min(STREAM_BUFFERS, layers))]
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.arrivals: dict[int, torch.cuda.Event | None] = {}
        self.copied_rows = 0  # cached rows brought to the device, all layers (tests)

    def begin(self, cache: Any, start: int) -> None:
        """A forward writing from slot `start` begins: the first layers' cached rows start crossing."""
        self.arrivals = {i: self._copy(cache, i, start) for i in range(len(self.buffers))}

    def layer(self, cache: Any, i: int, start: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values for this forward's attention, [kv_heads, end, head_dim] each, on the device: its
        cached rows as copied, then `k` and `v` (the new tokens' rows, [kv_heads, n, head_dim]), which also go
        back to host memory. The copy of layer i + STREAM_BUFFERS into the same buffer is issued behind this
        layer's work (after the caller's attention is enqueued: `then`)."""
        end = start + k.shape[1]
        wait(self.arrivals.pop(i))
        keys, values = self.buffers[i % len(self.buffers)]
        keys[:, start:end], values[:, start:end] = k, v
        cache.k[i, :, start:end].copy_(k, non_blocking=True)
        cache.v[i, :, start:end].copy_(v, non_blocking=True)
        return keys[:, :end], values[:, :end]

    def then(self, cache: Any, i: int, start: int) -> None:
        """Layer i's attention is enqueued: its buffer takes layer i + STREAM_BUFFERS next."""
        if i + len(self.buffers) < self.layers:
            self.arrivals[i + len(self.buffers)] = self._copy(cache, i + len(self.buffers), start)

    def _copy(self, cache: Any, i: int, rows: int) -> torch.cuda.Event | None:
        keys, values = self.buffers[i % len(self.buffers)]
        self.copied_rows += rows
        if self.copy_stream is None:
            keys[:, :rows].copy_(cache.k[i, :, :rows])
            values[:, :rows].copy_(cache.v[i, :, :rows])
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            keys[:, :rows].copy_(cache.k[i, :, :rows], non_blocking=True)
            values[:, :rows].copy_(cache.v[i, :, :rows], non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.copy_stream)
        return arrived


def wait(arrived: torch.cuda.Event | None) -> None:
    """The current stream waits for a copy's event (None: the copy was synchronous)."""
    if arrived is not None:
        torch.cuda.current_stream().wait_event(arrived)
