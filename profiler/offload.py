"""Where a modeled GPU keeps a model, and what a forward then costs: tensor parallelism over N GPUs and offloading to
host memory (`plan profile --gpu NAME [--gpus N] [--offload weights|kv] [--host-link LINK] [--resident fill|none]`).

Memory. Each GPU has its datasheet memory less DEVICE_RESERVE_BYTES. The draft (whole, or its 1/N share) and its KV
cache come first. Then, without offloading, the target's weights and every sequence's KV cache must fit. With
`--offload weights`, the target's embeddings, output head and KV caches stay on the device beside STREAM_BUFFERS
buffers of one layer's weights; as many of its layers as then fit stay too (the first ones), and the others stay in
pinned host memory and cross the host link every forward. With `--offload kv`, every weight stays on the device; as
many of the sequences' cached tokens as fit stay too (the same share of every layer), beside STREAM_BUFFERS buffers
of one layer's offloaded share, and the rest of every layer's keys and values crosses the link every forward: the
layout of TriForce's offloading, whose retrieval cache of a few thousand tokens then sits on the device.
`--resident none` keeps no layer (weights) or no cached token (kv) on the device: the layout of the offloading
systems the papers compare against (Sequoia's streams all 80 layers of Llama2-70B through two buffers).

Tensor parallelism (`--gpus N`): every GPU holds 1/N of each matmul's columns or rows, of the query and KV heads, of
the output head and of what is offloaded, and has its own host link. Two all-reduces per layer (after attention and
after the MLP) exchange the rows' hidden states, each ALLREDUCE_SECONDS plus 2 (N - 1) / N of its bytes at the
link's rate (consumer GPUs have no peer-to-peer path: their all-reduces cross the host link).

Time. One GPU's share of the forward costs t_chip (profiler/roofline.py: gpu_forward_seconds of the shard), spread
evenly over the layers: c = t_chip / layers + the layer's all-reduces. A layer's offloaded bytes arrive in x = bytes
/ (the link's rate * LINK_EFFICIENCY). The copies run in layer order on their own stream; a copy starts when the one
before it has finished and its buffer is free (the streamed layer STREAM_BUFFERS copies back has computed), and a
layer computes when the layer before it has and its copy has arrived. t(n) is when the last layer finishes: about
max(layers c, streamed layers x) plus the pipeline's fill, so t(n) stays flat in n until the compute of n rows
catches up with the link.

Host memory is taken to hold whatever is offloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specplan.core.choices import OFFLOAD_KINDS, RESIDENT_POLICIES
from specplan.core.errors import UserError
from specplan.decoder.model import ModelShape
from specplan.decoder.offload import DEVICE_RESERVE_BYTES, STREAM_BUFFERS
from specplan.profiler import roofline

# Pinned host-to-device copies reach about this share of a PCIe link's raw rate: every 256-byte payload carries about
# 24 bytes of packet header and framing (91% at best), and acknowledgements and flow-control packets share the link.
LINK_EFFICIENCY = 0.8
# One all-reduce of a few kilobytes between GPUs (NCCL's small-message latency over PCIe is tens of microseconds).
ALLREDUCE_SECONDS = 20e-6


@dataclass(frozen=True)
class HostLink:
    name: str
    gb_s: float  # raw rate per direction
    source: str


HOST_LINKS: dict[str, HostLink] = {link.name: link for link in (
    HostLink("pcie3-x16", 15.75, "PCI Express Base Specification 3.0: 8 GT/s per lane, 128b/130b encoding: 0.985 "
                                 "GB/s per lane and direction, 16 lanes"),
    HostLink("pcie4-x16", 31.5, "PCI Express Base Specification 4.0: 16 GT/s per lane, 128b/130b encoding: 1.97 GB/s "
                                "per lane and direction, 16 lanes"),
    HostLink("pcie5-x16", 63.0, "PCI Express Base Specification 5.0: 32 GT/s per lane, 128b/130b encoding: 3.94 GB/s "
                                "per lane and direction, 16 lanes"),
    HostLink("pcie4-x8", 15.75, "PCI Express Base Specification 4.0: 16 GT/s per lane, 8 lanes (a GPU in an x8 slot, "
                                "or two GPUs sharing an x16 switch)"),
    HostLink("nvlink-c2c", 450.0, "NVIDIA GH200 Grace Hopper Superchip datasheet (2023): NVLink-C2C 900 GB/s "
                                  "bidirectional between the Grace CPU's memory and the Hopper GPU"),
)}


def host_link(name: str) -> HostLink:
    if name not in HOST_LINKS:
        raise UserError(f"unknown host link {name!r} (known: {', '.join(HOST_LINKS)})")
    return HOST_LINKS[name]


@dataclass(frozen=True)
class ModelBytes:
    """One GPU's share of a model's memory, in bytes."""

    weights: float  # all of its weights
    layer: float  # one layer's matmul weights (what streams per layer)
    layers: int
    kv_per_token: float  # one cached token, every layer

    @classmethod
    def of(cls, shape: ModelShape, intermediate: int, parameters: int, dtype: str, gpus: int) -> ModelBytes:
        element = roofline.BYTES_PER_ELEMENT[dtype]
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        layer = shape.hidden * (q + 2 * kv) + q * shape.hidden + 3 * shape.hidden * intermediate
        return cls(parameters * element / gpus, layer * element / gpus, shape.layers,
                   2 * shape.layers * kv * element / gpus)


@dataclass(frozen=True)
class Placement:
    """What one GPU holds and streams for one forward's sequences; `fits` False where not even that layout fits."""

    fits: bool
    streamed_per_layer: tuple[float, ...] = ()  # bytes each layer brings over the link, in layer order
    resident_layers: int | None = None  # weights offloaded: the layers kept on the device
    resident_tokens: int | None = None  # KV offloaded: the cached tokens (all sequences') kept on the device

    @property
    def streamed(self) -> float:
        return sum(self.streamed_per_layer)


@dataclass(frozen=True)
class DeviceSetup:
    """N GPUs of one kind running one model with tensor parallelism, optionally offloading to host memory."""

    gpu: roofline.Accelerator
    gpus: int = 1
    offload: str | None = None  # weights | kv
    link: HostLink | None = None  # default: the GPU's own
    resident: str = "fill"

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise UserError("--gpus must be at least 1")
        if self.offload not in (None, *OFFLOAD_KINDS):
            raise UserError(f"--offload takes {' or '.join(OFFLOAD_KINDS)}, not {self.offload!r}")
        if self.resident not in RESIDENT_POLICIES:
            raise UserError(f"--resident takes {' or '.join(RESIDENT_POLICIES)}, not {self.resident!r}")
        if self.resident != "fill" and self.offload is None:
            raise UserError("--resident says what an offloaded model keeps on the device: it needs --offload")

    @property
    def host_link(self) -> HostLink:
        return self.link or HOST_LINKS[self.gpu.host_link]

    @property
    def link_bytes_per_second(self) -> float:
        return self.host_link.gb_s * 1e9 * LINK_EFFICIENCY

    @property
    def usable_bytes(self) -> float:
        return self.gpu.memory_gb * 1e9 - DEVICE_RESERVE_BYTES

    def shard(self, shape: ModelShape, intermediate: int, name: str) -> tuple[ModelShape, int]:
        """One GPU's share under tensor parallelism: the heads, the MLP's width and the vocabulary split N ways."""
        if self.gpus == 1:
            return shape, intermediate
        for what, size in (("attention heads", shape.heads), ("KV heads", shape.kv_heads),
                           ("MLP width", intermediate)):
            if size % self.gpus:
                raise UserError(f"{name}'s {size} {what} do not split over {self.gpus} GPUs")
        return (ModelShape(shape.architecture, shape.layers, shape.hidden, shape.heads // self.gpus,
                           shape.kv_heads // self.gpus, shape.head_dim, math.ceil(shape.vocab / self.gpus),
                           shape.max_context, shape.rope_theta, shape.rms_eps),
                intermediate // self.gpus)

    def place(self, target: ModelBytes, tokens: int, draft: ModelBytes | None = None, draft_tokens: int = 0
              ) -> Placement:
        """The target's layout on one GPU for `tokens` cached tokens (every sequence's, the new ones included), beside
        the draft and its `draft_tokens`."""
        free = self.usable_bytes - (draft.weights + draft.kv_per_token * draft_tokens if draft else 0.0)
        kv = target.kv_per_token * tokens
        if self.offload is None or (self.resident == "fill" and target.weights + kv <= free):
            fits = target.weights + kv <= free
            return Placement(fits, resident_layers=target.layers if self.offload == "weights" and fits else None,
                             resident_tokens=tokens if self.offload == "kv" and fits else None)
        if self.offload == "weights":
            free -= target.weights - target.layers * target.layer + kv + STREAM_BUFFERS * target.layer
            if free < 0:
                return Placement(False)
            resident = 0 if self.resident == "none" else min(target.layers, int(free // target.layer))
            streamed = [0.0] * resident + [target.layer] * (target.layers - resident)
            return Placement(True, tuple(streamed), resident_layers=resident)
        free -= target.weights
        per_layer = target.kv_per_token / target.layers  # one cached token in one layer
        # r resident tokens of T leave T - r to stream through buffers of one layer's share each:
        # r k + STREAM_BUFFERS (T - r) k / layers <= free
        if target.layers <= STREAM_BUFFERS or free < STREAM_BUFFERS * per_layer * tokens:
            return Placement(False)  # (with no more layers than buffers, streaming saves nothing)
        resident = 0 if self.resident == "none" else min(tokens, int(
            (free - STREAM_BUFFERS * per_layer * tokens) // (target.kv_per_token - STREAM_BUFFERS * per_layer)))
        share = (tokens - resident) * per_layer
        return Placement(True, (share,) * target.layers, resident_tokens=resident)

    def allreduce_seconds(self, rows: int, hidden: int, dtype: str) -> float:
        """One layer's two all-reduces of `rows` hidden states; none on one GPU."""
        if self.gpus == 1:
            return 0.0
        moved = 2 * (self.gpus - 1) / self.gpus * rows * hidden * roofline.BYTES_PER_ELEMENT[dtype]
        return 2 * (ALLREDUCE_SECONDS + moved / self.link_bytes_per_second)

    def forward_seconds(self, chip_seconds: float, layers: int, allreduce: float, placement: Placement) -> float:
        """The forward's time: `chip_seconds` of one GPU's share spread over its layers, each layer's `allreduce`,
        and the placement's streamed bytes pipelined through the buffers (the module docstring)."""
        compute = chip_seconds / layers + allreduce
        copies = placement.streamed_per_layer or (0.0,) * layers
        return pipelined_seconds(compute, [size / self.link_bytes_per_second for size in copies])

    def record(self) -> dict:
        """What a profile says of this setup (its `hardware` section)."""
        out: dict = {"gpus": self.gpus}
        if self.gpus > 1 or self.offload:
            link = self.host_link
            out["host_link"] = {"name": link.name, "gb_s": link.gb_s, "efficiency": LINK_EFFICIENCY,
                                "source": link.source}
        if self.offload:
            out["offload"] = self.offload
            out["resident"] = self.resident
        return out


def pipelined_seconds(compute: float, copies: list[float], buffers: int = STREAM_BUFFERS) -> float:
    """When the last layer finishes: each layer computes for `compute` seconds once the layer before it has and its
    copy (copies[i] seconds; 0: resident) has arrived; copies run one after another, each once a buffer is free."""
    done = copy_end = 0.0
    streamed_done: list[float] = []  # when each streamed layer finished computing: its buffer is free from then
    for seconds in copies:
        if seconds > 0:
            start = copy_end if len(streamed_done) < buffers else max(copy_end, streamed_done[-buffers])
            copy_end = start + seconds
            done = max(done, copy_end) + compute
            streamed_done.append(done)
        else:
            done += compute
    return done
