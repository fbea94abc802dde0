"""A lean forward for the Llama family and its relatives (Mistral, Qwen2/3, Phi-3, Gemma 2/3), in the spirit of
gpt-fast.

One forward scores `n` new tokens (a chain for prefill, a token tree for verification) against a static,
preallocated KV cache: their keys and values are written after the committed prefix, attention runs over
[cache | new tokens] with an additive mask, and `commit` compacts the accepted tokens into the prefix.
Weights are taken from the transformers model the shared loader returns (q/k/v and gate/up fused), and the
arithmetic mirrors transformers' (RMSNorm in fp32, RoPE tables in fp32), so fp32 greedy output matches.
Each family's differences from Llama are named options of this one forward (`Architecture`, read from the
transformers config); RoPE variants live in decoder/rope.py.

The same forward runs in one of two ways, chosen once per model:
- on a CPU, the project's kernels (decoder/kernels/cpu_kernels.cpp): a few calls per layer, weights in fp32, bf16 or
  a GGUF file's own blocks, attention over the first `length + n` cache slots;
- elsewhere (a GPU; a CPU where the kernels cannot be built, or a model whose widths are not whole kernel blocks),
  PyTorch's public operators. On a GPU they run in the static layout that CUDA graphs capture
  (decoder/cuda_graphs.py): every tensor shape depends on `n` only, new keys go in with index_copy_ at slot indices
  held in a tensor, attention runs over all `max_len` slots and the mask hides the unused ones.

What a method needs from a forward beyond its logits hangs on the cache it runs over, so that it is per sequence:
TriForce's retrieval cache reads the root's rotated queries (`KVCache.root_queries`); Phi-3's switch to its long
RoPE factors re-encodes one cache (`LongRopeSwitch`, state in `KVCache.long_rope`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from specplan.core.errors import UserError
from specplan.core.gguf_weights import BlockWeight
from specplan.decoder import cpu_kernels
from specplan.decoder.offload import KVStream, LayerStream
from specplan.decoder.rope import RotaryTables

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA_FAMILY = ("gemma2", "gemma3_text")
GRAPH_CACHE_SLOTS = 512  # with CUDA graphs, cache sizes are rounded up to this (see LeanModel.cache_for)
# Without CUDA graphs, a role's cache grows in blocks of this many slots and serves any sequence it holds: a server
# slot's next request a few tokens longer than its last (a longer answer allowed, a longer question) keeps the slot's
# cache; zeroing a new long-context cache costs a joining request more than a decoding step.
CACHE_BLOCK_SLOTS = 1024
# With CUDA graphs, the caches (and the graphs captured over them) kept per role: prompts of mixed lengths
# alternate among a few rounded sizes, and capturing a graph anew costs tens of its replays (two eager warm-up
# forwards and the capture).
KEPT_GRAPH_CACHES = 4
# The CPU kernels' matmuls take inputs of whole blocks (fp32: 16-value vectors; bf16 and GGUF blocks: 32 values,
# GGML's block size) and their norms and activations rows of whole 16-value vectors: a model whose widths are not
# runs on PyTorch's operators.
KERNEL_BLOCKS = {torch.float32: 16, torch.bfloat16: 32}
KERNEL_VECTOR = 16
KERNEL_FORMATS = {torch.float32: "F32", torch.bfloat16: "BF16"}  # the kernels' names (GGML's) of plain weights
# GGUF block formats whose matmuls round their input to 8-bit blocks (llama.cpp's Q8_K) in the CPU kernels
INPUT_ROUNDING_FORMATS = ("Q4_K", "Q6_K")


class MatmulWeight(NamedTuple):
    """A matmul weight [rows, cols] as the CPU kernels take it: the weight itself (fp32, bf16) or its GGUF blocks
    (uint8 [rows, bytes per row]), and its format's GGML name."""
    data: torch.Tensor
    format: str
    rows: int


Weight = torch.Tensor | MatmulWeight | tuple[MatmulWeight, ...]  # as the forward's matmuls take it (LeanModel._linear)


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_context: int
    rope_theta: float
    rms_eps: float

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """The sizes that set a forward's cost, of any decoder-only config (every RoPE variant costs the same)."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        max_context = config.max_position_embeddings
        if rope.get("rope_type") == "dynamic":  # dynamic NTK stretches the context by its factor
            max_context = int(max_context * rope["factor"])
        heads = config.num_attention_heads
        return cls(
            architecture=config.model_type,
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
            max_context=max_context,
            rope_theta=float(theta or 10000.0),
            rms_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        )


@dataclass(frozen=True)
class Architecture:
    """How a family's forward differs from Llama's: named options read from its transformers config."""

    name: str
    gemma_norm: bool = False  # Gemma: RMSNorm times (1 + w) in fp32, then cast; Llama: w times the cast norm
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head's q and k before RoPE
    sandwich_norms: bool = False  # Gemma 2/3: attention and MLP outputs normed too, before the residual
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden), rounded to the model's dtype
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU)
    attention_scale: float = 1.0  # 1/sqrt(head_dim), or Gemma's query_pre_attn_scalar^-0.5
    attention_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap) before the mask
    final_softcap: float | None = None  # Gemma 2/3: the same on the logits
    layer_windows: tuple[int | None, ...] = ()  # per layer, its sliding window (None: full attention)
    layer_rope: tuple[str | None, ...] = ()  # per layer, its RoPE parameter set (Gemma 3: per layer type)
    # Phi-3 (longrope): once the sequence outgrows the original context, its generate re-encodes every token with
    # the long factors (transformers' Phi3ForCausalLM.prepare_inputs_for_generation drops the cache there)
    reencodes_long_rope: bool = False

    @classmethod
    def from_config(cls, config: Any) -> Architecture:
        name = config.model_type
        if name not in SUPPORTED_ARCHITECTURES:
            raise UserError(f"architecture {name!r} is not supported by the lean decoder "
                            f"(it runs {', '.join(SUPPORTED_ARCHITECTURES)})")
        layers = config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if name in ("mistral", "phi3") or not layer_types:
            # Mistral and Phi-3 slide every layer's window when the config sets one
            windows = (window if name in ("mistral", "phi3") else None,) * layers
        else:
            windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types[:layers])
        gemma = name in GEMMA_FAMILY
        return cls(
            name=name,
            gemma_norm=gemma,
            qk_norm=name in ("qwen3", "gemma3_text"),
            sandwich_norms=gemma,
            embed_scale=config.hidden_size ** 0.5 if gemma else None,
            activation="gelu_tanh" if gemma else "silu",
            attention_scale=(config.query_pre_attn_scalar if gemma else head_dim) ** -0.5,
            attention_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
            layer_windows=windows,
            layer_rope=tuple(layer_types[:layers]) if name == "gemma3_text" else (None,) * layers,
            reencodes_long_rope=name == "phi3" and (config.rope_parameters or {}).get("rope_type") == "longrope",
        )


class KVCache:
    """Keys and values of all layers, [layers, kv_heads, max_len, head_dim]; `length` committed tokens."""

    def __init__(self, shape: ModelShape, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 streamed_to: torch.device | None = None):
        """`streamed_to`: keep the keys and values in host memory (pinned for a GPU) and stream them to that device
        every forward (decoder/offload.py: KVStream; `plan generate --offload kv`)."""
        size = (shape.layers, shape.kv_heads, max_len, shape.head_dim)
        if streamed_to is not None:
            device = "cpu"
        pinned = streamed_to is not None and streamed_to.type == "cuda"
        self.k = torch.zeros(size, dtype=dtype, device=device, pin_memory=pinned)
        self.v = torch.zeros(size, dtype=dtype, device=device, pin_memory=pinned)
        self.stream = (KVStream(shape.layers, shape.kv_heads, max_len, shape.head_dim, dtype, streamed_to)
                       if streamed_to is not None else None)
        self.layer_views = list(zip(self.k.unbind(0), self.v.unbind(0)))  # (keys, values) [kv_heads, max_len, d]
        self.max_len = max_len
        self.length = 0
        self.prompt_length = 0  # the prompt's length, for RoPE variants that depend on it (decoder/rope.py)
        self.long_rope = False  # Phi-3: the committed tokens are encoded with the long RoPE factors
        self.tokens = torch.zeros(max_len, dtype=torch.long, device=device)  # Phi-3: re-encoded at the switch
        # [layers, kv_heads, max_len]: the position of each slot's token, kept where slots are not positions (a
        # TriForce retrieval cache or a StreamingLLM cache of a model with sliding windows, whose masks need them);
        # None: slot i holds position i
        self.key_positions: torch.Tensor | None = None
        # [layers, heads, head_dim] or None: where set, every forward over this cache writes here the rotated query
        # of its first new token per layer (TriForce's retrieval cache selects its chunks by the root's query)
        self.root_queries: torch.Tensor | None = None
        # CUDA graphs captured over this cache's memory, by (number of new tokens, whether it hands out the root's
        # queries) (decoder/cuda_graphs.py); they live and die with it.
        self.graphs: dict[tuple[int, bool], tuple] = {}
        # the token ids of slots 0..len-1, where a finished sequence left them for the next one to share a prefix
        # with (a server's slot, decoder/batching.py); None: unknown. Emptied with the cache.
        self.held: list[int] | None = None

    def reset(self) -> None:
        """Empty, for a new sequence (its memory and CUDA graphs kept)."""
        self.length, self.prompt_length, self.long_rope, self.root_queries, self.held = 0, 0, False, None, None

    def keep_prefix(self, prompt: list[int]) -> None:
        """Start a sequence of `prompt` on what the last one left: the slots it shares with the prompt's tokens but
        the last are kept (the last is the first step's root), the rest emptied; everything without `held`."""
        shared = 0
        if self.held is not None and self.key_positions is None:
            limit = min(len(self.held), self.length, len(prompt) - 1)
            while shared < limit and self.held[shared] == prompt[shared]:
                shared += 1
        self.reset()
        self.length = shared

    def commit(self, kept: torch.Tensor | None, count: int) -> None:
        """Keep `count` of the slots written after the prefix: `kept` lists them (slot offsets from `length`,
        increasing), or None when they are already the first `count` slots."""
        start = self.length
        if kept is not None:
            slots = kept.to(self.k.device) + start
            self.k[:, :, start:start + count] = self.k[:, :, slots]
            self.v[:, :, start:start + count] = self.v[:, :, slots]
            self.tokens[start:start + count] = self.tokens[slots]
            if self.key_positions is not None:
                self.key_positions[:, :, start:start + count] = self.key_positions[:, :, slots]
        self.length = start + count

    def track_positions(self) -> None:
        """Keep each slot's position (see key_positions)."""
        layers, kv_heads, max_len = self.k.shape[:3]
        self.key_positions = torch.zeros(layers, kv_heads, max_len, dtype=torch.long, device=self.k.device)

    def move(self, source: slice, destination: slice) -> None:
        """Copy the entries of slots `source` to slots `destination` (as many), in every layer and head."""
        for tensor in (self.k, self.v) + ((self.key_positions,) if self.key_positions is not None else ()):
            tensor[:, :, destination] = tensor[:, :, source].clone()

    def truncate(self, length: int) -> None:
        self.length = length


class ForwardItem(NamedTuple):
    """One sequence's share of a batched forward (LeanModel.forward_many), as LeanModel.forward takes it."""

    tokens: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    cache: KVCache
    mask: torch.Tensor | None  # [n, cache.length + n] additive, or None: every slot visible
    logits_rows: torch.Tensor | slice | None = None  # the rows to score (all by default)


class LeanModel:
    backend = "lean"

    def __init__(self, hf_model: Any, device: torch.device | str = "cpu", release: bool = False,
                 vocabulary: int | None = None, always: Iterable[int] = (),
                 block_weights: dict[str, BlockWeight] | None = None, kernels: bool = True,
                 resident_layers: int | None = None, offload_kv: bool = False) -> None:
        """`release`: free each of `hf_model`'s weights once it is copied into this model's layout (fused, or on
        another device), layer by layer, so that no weight is held twice; `hf_model` is unusable after
        (core/models.py: LoadedModel.transformers_model loads it again). `vocabulary`, `always`: see
        limit_vocabulary. `block_weights`: the matmul weights in GGUF blocks, by parameter name (dtype gguf; run by
        the CPU kernels). `kernels`: on a CPU, run the CPU kernels (decoder/cpu_kernels.py) where they are built
        and the model's widths suit them; False runs PyTorch's operators. `resident_layers`: keep only the first
        ones on the device and stream the others from host memory every forward (decoder/offload.py; PyTorch's
        operators, no CUDA graphs). `offload_kv`: the "target" role's caches (cache_for) live in host memory and
        stream in every forward (decoder/offload.py: KVStream)."""
        config = hf_model.config
        self.architecture = Architecture.from_config(config)
        self.shape = ModelShape.from_config(config)
        self.device = torch.device(device)
        block = KERNEL_BLOCKS.get(hf_model.get_input_embeddings().weight.dtype, 0) if block_weights is None else 32
        whole_blocks = block > 0 and _kernel_widths_fit(self.shape, config.intermediate_size, self.architecture, block)
        streams = resident_layers is not None or offload_kv
        self.offload_kv = offload_kv
        self.kernels = (cpu_kernels.kernels() if kernels and not streams and self.device.type == "cpu" and whole_blocks
                        else None)
        if block_weights is not None and self.kernels is None:
            raise UserError("dtype gguf runs on the CPU kernels, which " + (
                "are not available here (a CPU device and a C++ compiler are needed)" if whole_blocks
                else "take widths of whole 32-value blocks"))
        params = dict(hf_model.named_parameters())
        self.dtype = params["model.embed_tokens.weight"].dtype
        # released weights are copied even where the layout would allow sharing: transformers maps each
        # safetensors file once, and a single tensor kept from it keeps the whole file's pages mapped
        take = lambda name: params[name].detach().to(self.device, copy=release)  # noqa: E731
        self.block_weights = block_weights or {}
        # Q4_K and Q6_K matmuls round their input to 8 bits: a last-bit difference before them moves logits by
        # hundredths, so each decoding row attends alone (kernels.attention's exact), as one-token decoding's would
        self.exact_attention = any(weight.format in INPUT_ROUNDING_FORMATS for weight in self.block_weights.values())
        self.embed: torch.Tensor | BlockWeight = self.block_weights.get("model.embed_tokens.weight") or take(
            "model.embed_tokens.weight")
        self.lm_head = (self.block_weights.get("lm_head.weight") or take("lm_head.weight")
                        if "lm_head.weight" in params else self.embed)
        self.final_norm = take("model.norm.weight")
        host_take = lambda name: params[name].detach().to("cpu", copy=release)  # noqa: E731
        self.layers = []
        for i in range(self.shape.layers):
            prefix = f"model.layers.{i}."
            on_device = resident_layers is None or i < resident_layers
            self.layers.append(self._layer_weights(params, prefix, take if on_device else host_take))
            if release:
                _free(params, [name for name in params if name.startswith(prefix)])
        self.layer_stream = (LayerStream(self.layers, resident_layers, self.device) if resident_layers is not None
                             else None)
        if self.layer_stream is not None:  # the streamed layers' weights: the stream's host copies only
            self.layers = self.layer_stream.resident + self.layer_stream.host
        self.output_ids: torch.Tensor | None = None  # set by limit_vocabulary
        if vocabulary is not None:
            self.limit_vocabulary(vocabulary, always)
        else:
            self.output_weight = self._matmul_weight(self.lm_head)
        if release:
            _free(params, list(params))
        self.graphed = None  # a decoder.cuda_graphs.GraphedForward, set by cuda_graphs.enable_cuda_graphs
        self.kept_caches: dict[str, OrderedDict[int, KVCache]] = {}  # by role, then size (cache_for)
        self.compiled_forward = None  # _forward through torch.compile, set by cuda_graphs.compile_forward
        d = self.shape.head_dim
        self.q_size, self.kv_size = self.shape.heads * d, self.shape.kv_heads * d
        arch = self.architecture
        self.embed_scale = (None if arch.embed_scale is None
                            else torch.tensor(arch.embed_scale, dtype=self.dtype, device=self.device))
        self.rotary = {kind: RotaryTables(config, kind, d, self.shape.max_context, self.dtype, self.device)
                       for kind in dict.fromkeys(arch.layer_rope)}
        self.position_dependent_rope = any(table.position_dependent for table in self.rotary.values())
        self.long_rope = LongRopeSwitch(self.rotary[None].original_max_position) if arch.reencodes_long_rope else None

    def _layer_weights(self, params: dict[str, torch.Tensor], prefix: str, take) -> dict[str, Any]:
        """One layer's weights, q/k/v and gate/up fused (Phi-3 checkpoints ship them fused)."""
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        optional = lambda name: take(name) if name in params else None  # noqa: E731
        if attn + "qkv_proj.weight" in params:
            wqkv, bqkv = self._fused_weight([attn + "qkv_proj.weight"], take), optional(attn + "qkv_proj.bias")
        else:
            wqkv = self._fused_weight([attn + f"{p}_proj.weight" for p in "qkv"], take)
            biases = [optional(attn + f"{p}_proj.bias") for p in "qkv"]
            bqkv = torch.cat(biases) if biases[0] is not None else None
        if mlp + "gate_up_proj.weight" in params:
            w_gate_up = self._fused_weight([mlp + "gate_up_proj.weight"], take)
            b_gate_up = optional(mlp + "gate_up_proj.bias")
        else:
            w_gate_up = self._fused_weight([mlp + "gate_proj.weight", mlp + "up_proj.weight"], take)
            biases = [optional(mlp + "gate_proj.bias"), optional(mlp + "up_proj.bias")]
            b_gate_up = torch.cat(biases) if biases[0] is not None else None
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        return {
            **{name: optional(prefix + name + ".weight") for name in norms},
            "q_norm": optional(attn + "q_norm.weight"), "k_norm": optional(attn + "k_norm.weight"),
            "wqkv": wqkv, "bqkv": bqkv,
            "wo": self._fused_weight([attn + "o_proj.weight"], take), "bo": optional(attn + "o_proj.bias"),
            "w_gate_up": w_gate_up, "b_gate_up": b_gate_up,
            "w_down": self._fused_weight([mlp + "down_proj.weight"], take), "b_down": optional(mlp + "down_proj.bias"),
        }

    def _fused_weight(self, names: list[str], take) -> Weight:
        """The matmul weight of the parameters `names` stacked by rows (q/k/v, gate/up): one matrix, or, for GGUF
        blocks the kernels take in different layouts, one per run of a layout (Q4_K_M: q and k in Q4_K, v in Q6_K;
        Q5_0 and Q8_0 run together, as Q8_0)."""
        blocks = [self.block_weights.get(name) for name in names]
        if blocks[0] is None:
            return self._matmul_weight(torch.cat([take(name) for name in names]) if len(names) > 1 else take(names[0]))
        runs: list[list[MatmulWeight]] = []
        for weight in (self._matmul_weight(block) for block in blocks):
            if runs and runs[-1][0].format == weight.format:
                runs[-1].append(weight)
            else:
                runs.append([weight])
        parts = tuple(run[0] if len(run) == 1 else MatmulWeight(torch.cat([w.data for w in run]), run[0].format,
                                                                sum(w.rows for w in run)) for run in runs)
        return parts[0] if len(parts) == 1 else parts

    def _matmul_weight(self, weight: torch.Tensor | BlockWeight) -> torch.Tensor | MatmulWeight:
        """A weight as this model's matmuls take it: named by its format for the CPU kernels (GGUF blocks in the
        layout the kernels read fastest: Q4_K's rows interleaved by 8 on AVX2, Q5_0 as Q8_0), else the tensor."""
        if isinstance(weight, BlockWeight):
            repacked = self.kernels.repack(weight.format, weight.data, weight.rows, weight.cols)
            if repacked is not None:
                return MatmulWeight(repacked[1], repacked[0], weight.rows)
            return MatmulWeight(weight.data, weight.format, weight.rows)
        if self.kernels is not None:
            return MatmulWeight(weight.contiguous(), KERNEL_FORMATS[weight.dtype], weight.shape[0])
        return weight

    def limit_vocabulary(self, size: int, always: Iterable[int] = ()) -> None:
        """Score only the token ids below `size`, plus `always` (the stop tokens); every other logit is -inf.

        Meant for a draft model: on a memory-bound CPU its output matrix is a large share of the bytes a step
        reads (27% for qwen2.5-coder-0.5b), and BPE ids are numbered in merge order, so a prefix of the
        vocabulary holds most of the tokens worth drafting. Speculation stays lossless: the target verifies."""
        if self.output_ids is not None:
            raise UserError("the vocabulary of this model is already limited")
        self.output_ids = torch.tensor(draft_vocabulary_ids(size, always, self.shape.vocab), device=self.device)
        self.lm_head = (self.lm_head.take_rows(self.output_ids) if isinstance(self.lm_head, BlockWeight)
                        else self.lm_head[self.output_ids].contiguous())
        self.output_weight = self._matmul_weight(self.lm_head)

    def new_cache(self, max_len: int, host: bool = False) -> KVCache:
        """`host`: in host memory, streamed to the device every forward."""
        if max_len > self.shape.max_context:
            raise UserError(f"a cache of {max_len} tokens exceeds the model's maximum context {self.shape.max_context}")
        return KVCache(self.shape, max_len, self.dtype, self.device, streamed_to=self.device if host else None)

    def kept_cache(self, role: str) -> KVCache | None:
        """The cache this model last handed `role`, as its sequence left it (None: none yet)."""
        kept = self.kept_caches.get(role)
        return next(iter(kept.values())) if kept else None

    def cache_for(self, max_len: int, role: str, exact: bool = False, keep: bool = False) -> KVCache:
        """An empty cache of at least `max_len` slots for `role` (the engine's "target", a drafter's own), of exactly
        `max_len` with `exact`. With `keep` (no CUDA graphs), the kept cache as it is, contents and all (a server's
        slot: its next sequence may share a prefix with the last, KVCache.keep_prefix); where it is too small, a
        larger one holding its kept prefix.

        Without CUDA graphs, one cache per role, which serves every sequence it holds and is replaced by a larger one,
        CACHE_BLOCK_SLOTS at a time, where one does not fit. With CUDA graphs, `max_len` is rounded up to
        GRAPH_CACHE_SLOTS (unless `exact`) and up to KEPT_GRAPH_CACHES sizes are kept per role, least recently used
        first out, so that generations of mixed lengths replay the graphs captured over their caches instead of
        capturing new ones. Generations of one role must not overlap (they share the cache)."""
        kept = self.kept_caches.setdefault(role, OrderedDict())
        host = self.offload_kv and role == "target"
        if self.graphed is None:
            last = next(iter(kept.values()), None)
            if last is not None and (last.max_len == max_len if exact else last.max_len >= max_len):
                if not keep:
                    last.reset()
                return last
            if not keep or last is None or last.held is None:
                kept.clear()  # free the old cache before the new one takes its memory
                last = None
            cache = self.new_cache(max_len if exact else cache_slots(max_len, self.shape.max_context), host=host)
            if last is not None:  # the kept prefix copied along
                cache.k[:, :, :last.length] = last.k[:, :, :last.length]
                cache.v[:, :, :last.length] = last.v[:, :, :last.length]
                cache.length, cache.held = last.length, last.held
            kept.clear()
            kept[cache.max_len] = cache
            return cache
        if not exact:
            max_len = min(-(-max_len // GRAPH_CACHE_SLOTS) * GRAPH_CACHE_SLOTS, self.shape.max_context)
        cache = kept.pop(max_len, None)
        if cache is None:
            cache = self.new_cache(max_len, host=host)
        else:
            cache.reset()
        kept[max_len] = cache
        while len(kept) > KEPT_GRAPH_CACHES:
            kept.popitem(last=False)
        return cache

    @property
    def has_windows(self) -> bool:
        return any(window is not None for window in self.architecture.layer_windows)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
                logits_rows: torch.Tensor | slice | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Score `tokens` ([n]) at `positions` ([n]); returns logits [rows, vocab] for `logits_rows` (all by default).

        Dynamic layout (slots None): new keys go to cache slots length..length+n-1 and `mask` is an additive
        [n, length+n] mask, or None when every new token may see every slot (n = 1). Static layout (PyTorch's
        operators; CUDA graphs capture it): `slots` ([n]) are the cache slots to write and `mask` is [n, max_len].
        The cache length is not advanced.
        """
        if self.graphed is not None and slots is None and cache.key_positions is None:
            return self.graphed(tokens, positions, cache, mask, logits_rows)
        if self.compiled_forward is not None and slots is not None and cache.root_queries is None:
            return self.compiled_forward(tokens, positions, cache, mask, logits_rows, slots)
        if self.long_rope is not None and self.long_rope.due(positions, cache):
            return self.long_rope.forward(self, tokens, positions, cache, mask, logits_rows, slots)
        return self._forward(tokens, positions, cache, mask, logits_rows, slots)

    def forward_many(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """Score several sequences' new tokens in one forward, each over its own cache: logits per item, as
        `forward` returns them. The rows share every matmul (each weight read once for the batch); attention runs
        per sequence over its own keys (on the CPU kernels, one call for the batch). With CUDA graphs, one graph
        per (sequences' caches, rows per sequence) (decoder/cuda_graphs.py: GraphedForward.many). A forward that
        crosses Phi-3's long-RoPE switch runs each item alone."""
        if len(items) == 1 or (
                self.long_rope is not None and any(self.long_rope.due(item.positions, item.cache) for item in items)):
            return [self.forward(*item) for item in items]
        if self.kernels is not None:
            return self._forward_kernels(items)
        if self.graphed is not None and self.graphed.takes(items):
            return self.graphed.many(items)
        return self._forward_operators(items)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
                 logits_rows: torch.Tensor | slice | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        item = ForwardItem(tokens, positions, cache, mask, logits_rows)
        if self.kernels is not None and slots is None:
            return self._forward_kernels([item])[0]
        return self._forward_operators([item], None if slots is None else [slots])[0]

    def _forward_operators(self, items: list[ForwardItem], slots: list[torch.Tensor] | None = None
                           ) -> list[torch.Tensor]:
        """The forward on PyTorch's operators for one sequence's rows or several sequences' at once (logits per
        item): the norms, projections and MLP over all the rows (a batch reads each weight once), RoPE, the cache
        writes and attention per sequence over its own keys. Dynamic layout, or (given `slots`, one [n] tensor
        per item) the static one."""
        shape, arch = self.shape, self.architecture
        counts = [item.tokens.shape[0] for item in items]
        rows = sum(counts)
        tokens = torch.cat([item.tokens.to(self.device) for item in items]) if len(items) > 1 else (
            items[0].tokens.to(self.device))
        x = self._embed(tokens)
        tables = [{kind: table(item.positions.to(self.device), item.cache.prompt_length, item.cache.long_rope)
                   for kind, table in self.rotary.items()} for item in items]  # [n, rotary_dim] each
        rope = tables[0] if len(items) == 1 else {
            kind: tuple(torch.cat([t[kind][j] for t in tables]) for j in (0, 1)) for kind in self.rotary}
        sequences = []  # per item: (first row, rows, start, end, slots, layer masks, their SDPA forms)
        first = 0
        for b, (item, n) in enumerate(zip(items, counts)):
            cache, positions = item.cache, item.positions.to(self.device)
            mask = None if item.mask is None else item.mask.to(self.device, self.dtype)
            written = None if slots is None else slots[b]
            start, end = cache.length, cache.length + n
            if cache.key_positions is not None:
                if written is None:
                    cache.key_positions[:, :, start:end] = positions
                else:
                    cache.key_positions.index_copy_(2, written, positions.expand(*cache.key_positions.shape[:2], n))
            if cache.stream is not None:
                if written is not None:
                    raise UserError("a cache in host memory is written in the dynamic layout only")
                cache.stream.begin(cache, start)
            if self.long_rope is not None:
                if written is None:
                    cache.tokens[start:end] = tokens[first:first + n]
                else:
                    cache.tokens.index_copy_(0, written, tokens[first:first + n])
            layer_masks = self._layer_masks(mask, positions, cache, mask.shape[-1] if mask is not None else end,
                                            written)
            sdpa_masks = {id(layer_mask): _sdpa_form(layer_mask, self) for layer_mask in layer_masks}
            sequences.append((first, n, start, end, written, layer_masks, sdpa_masks))
            first += n
        for i, layer in enumerate(self.layer_stream.layers() if self.layer_stream else self.layers):
            cos, sin = rope[arch.layer_rope[i]]
            h = self._rms_norm(x, layer["input_layernorm"])
            qkv = self._linear(h, layer["wqkv"], layer["bqkv"])
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = q.view(rows, shape.heads, shape.head_dim), k.view(rows, shape.kv_heads, shape.head_dim)
            if arch.qk_norm:
                q, k = self._rms_norm(q, layer["q_norm"]), self._rms_norm(k, layer["k_norm"])
            q = self._rope(q.transpose(0, 1), cos, sin)  # [heads, rows, head_dim]
            k = self._rope(k.transpose(0, 1), cos, sin)
            v = v.view(rows, shape.kv_heads, shape.head_dim).transpose(0, 1)
            attended = []
            for item, (first, n, start, end, written, layer_masks, sdpa_masks) in zip(items, sequences):
                cache, own = item.cache, slice(first, first + n)
                if cache.root_queries is not None:
                    cache.root_queries[i] = q[:, first]
                if cache.stream is not None:
                    keys, values = cache.stream.layer(cache, i, start, k[:, own], v[:, own])
                elif written is None:
                    cache.k[i, :, start:end] = k[:, own]
                    cache.v[i, :, start:end] = v[:, own]
                    keys, values = cache.k[i, :, :end], cache.v[i, :, :end]
                else:
                    cache.k[i].index_copy_(1, written, k[:, own])
                    cache.v[i].index_copy_(1, written, v[:, own])
                    keys, values = cache.k[i], cache.v[i]
                attended.append(self._attention(q[:, own], keys, values, layer_masks[i],
                                                sdpa_masks[id(layer_masks[i])]))
                if cache.stream is not None:
                    cache.stream.then(cache, i, start)
            out = attended[0] if len(items) == 1 else torch.cat(attended, dim=1)
            out = self._linear(out.transpose(0, 1).reshape(rows, self.q_size), layer["wo"], layer["bo"])
            if arch.sandwich_norms:
                x = x + self._rms_norm(out, layer["post_attention_layernorm"])
                h = self._rms_norm(x, layer["pre_feedforward_layernorm"])
            else:
                x = x + out
                h = self._rms_norm(x, layer["post_attention_layernorm"])
            gate, up = self._linear(h, layer["w_gate_up"], layer["b_gate_up"]).chunk(2, dim=-1)
            gated = (F.silu(gate) if arch.activation == "silu" else F.gelu(gate, approximate="tanh")) * up
            out = self._linear(gated, layer["w_down"], layer["b_down"])
            x = x + (self._rms_norm(out, layer["post_feedforward_layernorm"]) if arch.sandwich_norms else out)
        if len(items) == 1:
            rows_scored = items[0].logits_rows
            return [self._logits(self._rms_norm(x if rows_scored is None else x[rows_scored], self.final_norm))]
        kept = [x[first:first + n] if item.logits_rows is None else x[first:first + n][item.logits_rows]
                for item, (first, n, *_) in zip(items, sequences)]
        scored = self._logits(self._rms_norm(torch.cat(kept), self.final_norm))  # one output matmul for the batch
        return list(scored.split([part.shape[0] for part in kept]))

    def _forward_kernels(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """_forward_operators' arithmetic in a few CPU kernel calls per layer (decoder/kernels/cpu_kernels.cpp), for
        the rows of one or several sequences at once: the norms, projections and MLP over all their rows, RoPE fused
        with each sequence's cache writes, attention per sequence over its own keys (_attend), the residual add fused
        into the next norm. Logits per item."""
        kernels, shape, arch = self.kernels, self.shape, self.architecture
        eps, gemma, gelu = shape.rms_eps, arch.gemma_norm, arch.activation != "silu"
        counts = [item.tokens.shape[0] for item in items]
        starts = [item.cache.length for item in items]
        ends = [start + count for start, count in zip(starts, counts)]
        x = self._embed(torch.cat([item.tokens for item in items]) if len(items) > 1 else items[0].tokens)
        if len(items) == 1 or not self.position_dependent_rope:  # one table lookup for every row
            positions = torch.cat([item.positions for item in items]) if len(items) > 1 else items[0].positions
            cache = items[0].cache
            rope = {kind: table(positions, cache.prompt_length, cache.long_rope) for kind, table in self.rotary.items()}
        else:  # each sequence's own prompt length and long-RoPE state
            tables = [{kind: table(item.positions, item.cache.prompt_length, item.cache.long_rope)
                       for kind, table in self.rotary.items()} for item in items]
            rope = {kind: tuple(torch.cat([t[kind][j] for t in tables]) for j in (0, 1)) for kind in self.rotary}
        item_masks = []  # per item, per layer: [n, end] or [kv_heads, n, end] (a sliding window hides old keys)
        for item, start, end in zip(items, starts, ends):
            cache = item.cache
            if cache.key_positions is not None:
                cache.key_positions[:, :, start:end] = item.positions
            if self.long_rope is not None:
                cache.tokens[start:end] = item.tokens
            mask = None if item.mask is None else item.mask.float()
            item_masks.append(self._layer_masks(mask, item.positions, cache, end, None))
        # per item whose cache takes its root's queries (TriForce's retrieval), per layer: the root's row of each head,
        # stacked into the cache once after the layers (a copy a layer was the dearest of the engine's work in a step)
        firsts = list(itertools.accumulate([0] + counts[:-1]))
        root_rows: dict[int, list[torch.Tensor]] = {j: [] for j, item in enumerate(items)
                                                    if item.cache.root_queries is not None}
        residual = None  # each block's output, added to x by the next norm
        for i, layer in enumerate(self.layers):
            views = [item.cache.layer_views[i] for item in items]
            keys, values = [view[0] for view in views], [view[1] for view in views]
            h = kernels.rms_norm(x, residual, layer["input_layernorm"], eps, gemma)
            qkv = self._linear(h, layer["wqkv"], layer["bqkv"])
            cos, sin = rope[arch.layer_rope[i]]
            q = kernels.rope_store(qkv, cos, sin, keys, values, starts, counts, shape.heads, shape.kv_heads,
                                   layer["q_norm"], layer["k_norm"], eps, gemma)  # [rows * heads, head_dim]
            for j, rows in root_rows.items():  # the block [heads, n, d] of the item's rows: every n-th row its root's
                rows.append(q[shape.heads * firsts[j]:shape.heads * (firsts[j] + counts[j]):counts[j]])
            attended = self._attend(q, keys, values, counts, ends, [layer_masks[i] for layer_masks in item_masks])
            out = self._linear(attended, layer["wo"], layer["bo"])
            if arch.sandwich_norms:
                out = kernels.rms_norm(out, None, layer["post_attention_layernorm"], eps, gemma)
                h = kernels.rms_norm(x, out, layer["pre_feedforward_layernorm"], eps, gemma)
            else:
                h = kernels.rms_norm(x, out, layer["post_attention_layernorm"], eps, gemma)
            gated = kernels.gated_activation(self._linear(h, layer["w_gate_up"], layer["b_gate_up"]), gelu)
            residual = self._linear(gated, layer["w_down"], layer["b_down"])
            if arch.sandwich_norms:
                residual = kernels.rms_norm(residual, None, layer["post_feedforward_layernorm"], eps, gemma)
        for j, rows in root_rows.items():
            torch.stack(rows, out=items[j].cache.root_queries)
        h = kernels.rms_norm(x, residual, self.final_norm, eps, gemma)
        if len(items) == 1:
            rows = items[0].logits_rows
            return [self._logits(h if rows is None else h[rows])]
        logits, first = [], 0
        for item, count in zip(items, counts):
            rows = h[first:first + count]
            logits.append(rows if item.logits_rows is None else rows[item.logits_rows])
            first += count
        scored = self._logits(torch.cat(logits))  # one output matmul for the batch
        return list(scored.split([row.shape[0] for row in logits]))

    def _attend(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], counts: list[int],
                ends: list[int], masks: list[torch.Tensor | None]) -> torch.Tensor:
        """One layer's attention on the CPU kernels: q [rows * heads, head_dim] as rope_store returns it (each
        sequence's block [heads, n, head_dim]) over each sequence's keys and values [kv_heads, slots, head_dim] up to
        its end; [rows, heads * head_dim]. A prompt (from the kernels' prompt_rows new tokens; not under a soft cap)
        attends through SDPA, as it would alone, so a request's cache does not depend on the prompts prefilled beside
        it; the other sequences' rows in one kernels.attention call. A sequence of the host's sdpa_rows new tokens or
        more attends through SDPA too, alone or beside others, except where the matmuls round their input
        (exact_attention): there each decoding row's bits are its own (cpu_kernels.cpp)."""
        shape, scale = self.shape, self.architecture.attention_scale
        softcap = self.architecture.attention_softcap or 0.0
        exact = self.exact_attention
        sdpa_from = self.kernels.prompt_rows if exact else self.kernels.sdpa_rows
        through_sdpa = [b for b, n in enumerate(counts) if n >= sdpa_from and not softcap]
        if not through_sdpa:
            return self.kernels.attention(q, keys, values, counts, ends, [_kernel_mask(m) for m in masks], scale,
                                          softcap, exact)
        blocks = list(q.split([shape.heads * n for n in counts]))
        in_kernels = [b for b in range(len(counts)) if b not in through_sdpa]
        attended: list[torch.Tensor | None] = [None] * len(counts)
        if in_kernels:
            rows = self.kernels.attention(torch.cat([blocks[b] for b in in_kernels]), [keys[b] for b in in_kernels],
                                          [values[b] for b in in_kernels], [counts[b] for b in in_kernels],
                                          [ends[b] for b in in_kernels], [_kernel_mask(masks[b]) for b in in_kernels],
                                          scale, softcap, exact)
            for b, part in zip(in_kernels, rows.split([counts[b] for b in in_kernels])):
                attended[b] = part
        for b in through_sdpa:  # [heads, n, d] -> [n, heads * d]
            n, end = counts[b], ends[b]
            out = F.scaled_dot_product_attention(
                blocks[b].view(1, shape.heads, n, shape.head_dim), keys[b][None, :, :end], values[b][None, :, :end],
                attn_mask=_sdpa_form(masks[b], self), scale=scale, enable_gqa=shape.kv_heads != shape.heads)[0]
            attended[b] = out.transpose(0, 1).reshape(n, self.q_size)
        return attended[0] if len(counts) == 1 else torch.cat(attended)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of the final-normed hidden rows `h`: the output matmul, Gemma's soft cap, and -inf
        for the ids a limited vocabulary does not score."""
        logits = self._linear(h, self.output_weight)
        if self.architecture.final_softcap is not None:
            cap = self.architecture.final_softcap
            logits = torch.tanh(logits / cap) * cap
        if self.output_ids is None:
            return logits
        scored = logits.new_full((logits.shape[0], self.shape.vocab), float("-inf"))
        return scored.index_copy_(1, self.output_ids, logits)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.shape.rms_eps)
        if self.architecture.gemma_norm:
            return (h * (1.0 + weight.float())).to(x.dtype)
        return weight * h.to(x.dtype)

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                   sdpa_mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + mask) v for q [heads, n, d] over keys/values [kv_heads, L, d].

        Few query rows (decode steps, token trees) are computed with two grouped matmuls: on a CPU, SDPA runs one
        bf16 query row over long contexts several times slower, and its fp32 path gains nothing until about 16
        rows; on a GPU, see cuda_grouped_attention. Longer blocks (prefill) go to SDPA."""
        n = q.shape[1]
        softcap, scale = self.architecture.attention_softcap, self.architecture.attention_scale
        if softcap is not None or self._grouped_attention(n, keys.shape[1]):
            heads, d = q.shape[0], q.shape[2]
            kv_heads, length = keys.shape[0], keys.shape[1]
            group = heads // kv_heads
            scores = (q.reshape(kv_heads, group * n, d) @ keys.transpose(1, 2)).float() * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if mask is not None:  # [n, L], or [kv_heads, n, L] (one per KV head)
                per_head = mask.float() if mask.dim() == 2 else mask.float()[:, None]
                scores = (scores.view(kv_heads, group, n, length) + per_head).view(kv_heads, group * n, length)
            weights = scores.softmax(-1).to(values.dtype)
            return (weights @ values).view(heads, n, d)
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=sdpa_mask, scale=scale,
                                              enable_gqa=self.shape.kv_heads != self.shape.heads)[0]

    def _grouped_attention(self, n: int, keys: int) -> bool:
        if self.device.type == "cuda":
            return cuda_grouped_attention(n, keys, self.dtype == torch.float32)
        return self.device.type == "cpu" and n <= (32 if self.dtype == torch.bfloat16 else 8)

    def _linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, MatmulWeight):
            return self.kernels.linear(x.contiguous(), weight.format, weight.data, bias, weight.rows)
        if isinstance(weight, tuple):  # GGUF blocks of several formats: one matmul each, outputs side by side
            out = torch.cat([self._linear(x, part) for part in weight], dim=-1)
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, BlockWeight):
            x = self.kernels.dequantize_rows(self.embed.format, self.embed.data, self.embed.cols, tokens)
            x = x.to(self.dtype)
        else:
            x = F.embedding(tokens, self.embed)
        return x if self.embed_scale is None else x * self.embed_scale

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotary_dim = cos.shape[-1]
        if rotary_dim < x.shape[-1]:  # partial rotary: the rest of each head passes through
            return torch.cat([self._rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
        half = rotary_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _layer_masks(self, mask: torch.Tensor | None, positions: torch.Tensor, cache: KVCache, span: int,
                     slots: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Per layer, its additive mask ([n, span], or [kv_heads, n, span] where the cache keeps each slot's
        position per head): `mask` for full attention, and for a sliding window W `mask` with every key at W or more
        positions before the query hidden (transformers: kv > q - W). A slot holds the token of its own position
        unless the cache keeps `key_positions` (the forward wrote the new tokens' there); the new tokens sit at
        `positions`."""
        windows = self.architecture.layer_windows
        if not self.has_windows:
            return [mask] * len(windows)
        if cache.key_positions is None:
            key_positions = torch.arange(span, device=self.device)
            if slots is None:
                key_positions[cache.length:cache.length + positions.shape[0]] = positions
            else:
                key_positions = key_positions.index_copy(0, slots, positions)
            distance = positions[:, None] - key_positions[None, :]  # [n, span]
        else:
            distance = positions[None, None, :, None] - cache.key_positions[:, :, None, :span]  # [layers, kv, n, span]
        base = mask if mask is not None else torch.zeros(distance.shape[-2:], dtype=self.dtype, device=self.device)
        by_window: dict[int | None, torch.Tensor | None] = {None: mask}
        layer_masks = []
        for i, window in enumerate(windows):
            if window is not None and cache.key_positions is not None:
                layer_masks.append(base.masked_fill(distance[i] >= window, float("-inf")))
                continue
            if window not in by_window:
                by_window[window] = base.masked_fill(distance >= window, float("-inf"))
            layer_masks.append(by_window[window])
        return layer_masks

    def prefill(self, tokens: torch.Tensor, cache: KVCache, chunk: int = 512, logits: bool = True,
                prompt_length: int | None = None) -> torch.Tensor | None:
        """Append `tokens` to the cache in causal chunks; returns the last token's logits ([vocab]) if asked.
        `prompt_length`: the whole prompt's, when these tokens start it but leave some of it to later forwards
        (by default, a prefill into an empty cache is the prompt)."""
        if cache.length + tokens.shape[0] > cache.max_len:
            raise UserError(f"{cache.length + tokens.shape[0]} tokens do not fit the {cache.max_len}-token cache")
        if prompt_length is not None or cache.length == 0:
            cache.prompt_length = prompt_length if prompt_length is not None else tokens.shape[0]
        graphed, self.graphed = self.graphed, None  # prefill chunks run eagerly: no graph per chunk size
        try:
            return prefill_in_chunks(self, tokens, cache, chunk, logits)
        finally:
            self.graphed = graphed


class LongRopeSwitch:
    """Phi-3 (longrope): once a sequence outgrows the original context, its generate re-encodes every token with the
    long factors (transformers' Phi3ForCausalLM.prepare_inputs_for_generation drops the cache there). Per cache:
    `KVCache.long_rope` says that its tokens are encoded with the long factors."""

    def __init__(self, original_context: int) -> None:
        self.original_context = original_context

    def _lengths(self, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return torch.clamp(positions + 1, min=cache.prompt_length)  # decoder/rope.py: each token's sequence length

    def due(self, positions: torch.Tensor, cache: KVCache) -> bool:
        return not cache.long_rope and bool((self._lengths(positions, cache) > self.original_context).any())

    def forward(self, model: LeanModel, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None, logits_rows: torch.Tensor | slice | None,
                slots: torch.Tensor | None) -> torch.Tensor:
        """The forward that crosses the switch, as Phi-3's generate makes it: rows whose sequence still fits the
        original context are scored with the short factors; then the committed tokens are encoded again with the
        long factors, and the other rows are scored over them (the long-factor keys stay in the cache)."""
        within = (self._lengths(positions, cache) <= self.original_context).to(model.device)
        short = model._forward(tokens, positions, cache, mask, None, slots) if bool(within.any()) else None
        cache.long_rope = True
        if cache.length:
            committed, length = cache.tokens[:cache.length].clone(), cache.length
            cache.length = 0
            prefill_in_chunks(model, committed, cache, 512, logits=False)
            assert cache.length == length
        logits = model._forward(tokens, positions, cache, mask, None, slots)
        if short is not None:
            logits[within] = short[within]
        return logits if logits_rows is None else logits[logits_rows]


def _kernel_widths_fit(shape: ModelShape, intermediate: int, architecture: Architecture, block: int) -> bool:
    """Whether every matmul input is whole `block`s and every normed or activated row whole KERNEL_VECTORs (every
    released model's are; tests' toy models need not be)."""
    matmul_inputs = (shape.hidden, shape.heads * shape.head_dim, intermediate)
    rows = (shape.hidden, intermediate) + ((shape.head_dim,) if architecture.qk_norm else ())
    return all(w % block == 0 for w in matmul_inputs) and all(w % KERNEL_VECTOR == 0 for w in rows)


def cuda_grouped_attention(n: int, keys: int, fp32: bool) -> bool:
    """Whether a GPU forward of n rows over `keys` keys runs attention as grouped matmuls rather than SDPA (see
    LeanModel._attention); profiler/roofline.py prices the two paths apart."""
    return 2 <= n <= 64 and (fp32 or keys >= 4096)


def _kernel_mask(mask: torch.Tensor | None) -> torch.Tensor:
    """A mask as kernels.attention takes it: an empty tensor for none."""
    return torch.empty(0) if mask is None else mask


def _sdpa_form(mask: torch.Tensor | None, model: LeanModel) -> torch.Tensor | None:
    """A mask as SDPA takes it: [1, 1 or heads, n, L] in the model's dtype."""
    if mask is None:
        return None
    if mask.dim() == 3:  # one per KV head: repeated over each head's query group
        return mask.repeat_interleave(model.shape.heads // model.shape.kv_heads, dim=0)[None].to(model.dtype)
    return mask[None, None].to(model.dtype)


def _free(params: dict[str, torch.Tensor], names: Iterable[str]) -> None:
    """Free transformers' copies of the weights `names` (the lean model holds its own)."""
    for name in names:
        weight = params[name]
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)


def prefill_in_chunks(model: Any, tokens: torch.Tensor, cache: Any, chunk: int, logits: bool) -> torch.Tensor | None:
    """Append `tokens` to `model`'s cache in causal chunks of `chunk`, committing each; the last token's logits
    ([vocab]) if `logits`. `model` is any forward with the lean one's contract (LeanModel, TransformersForward)."""
    last = None
    for begin in range(0, tokens.shape[0], chunk):
        piece = tokens[begin:begin + chunk].to(model.device)
        n = piece.shape[0]
        positions = torch.arange(cache.length, cache.length + n, device=model.device)
        mask = causal_mask(cache.length, n, model.dtype, model.device) if n > 1 else None
        final = logits and begin + chunk >= tokens.shape[0]
        last = model.forward(piece, positions, cache, mask, logits_rows=slice(n - 1, n) if final else slice(0, 0))
        cache.commit(None, n)
    return last[0] if logits and last is not None else None


def prefill_together(model: LeanModel, prompts: list[torch.Tensor], caches: list[KVCache],
                     prompt_lengths: list[int] | None = None) -> None:
    """Several sequences' prompt tokens (each at most a prefill chunk) appended to their own caches (empty, or
    holding a prefix kept from the slot's last sequence) in one batched forward (LeanModel.forward_many), each
    causal over its own cache; `prompt_lengths`: each whole prompt's (None: the tokens continue the caches' own)."""
    for cache, length in zip(caches, prompt_lengths or ()):
        cache.prompt_length = length
    graphed, model.graphed = model.graphed, None  # eagerly, as LeanModel.prefill: no graph per prompts' shape
    try:
        model.forward_many([prompt_item(model, tokens, cache) for tokens, cache in zip(prompts, caches)])
    finally:
        model.graphed = graphed
    for tokens, cache in zip(prompts, caches):
        cache.commit(None, tokens.shape[0])


def prompt_item(model: LeanModel, tokens: torch.Tensor, cache: KVCache) -> ForwardItem:
    """Prompt tokens ([n]) appended after what `cache` holds, each seeing the cache and the tokens up to itself; no
    logits (a batched forward's share of a prefill)."""
    n, start = tokens.shape[0], cache.length
    mask = causal_mask(start, n, model.dtype, model.device) if n > 1 else None
    return ForwardItem(tokens.to(model.device), torch.arange(start, start + n, device=model.device), cache, mask,
                       slice(0, 0))


def draft_vocabulary_ids(size: int, always: Iterable[int], vocab: int) -> list[int]:
    """The token ids a draft limited to `size` scores: those below `size` and the `always` ones."""
    if not 0 < size <= vocab:
        raise UserError(f"a draft vocabulary of {size} tokens is outside 1..{vocab}")
    return sorted(set(range(size)) | {int(i) for i in always if 0 <= int(i) < vocab})


def cache_slots(max_len: int, max_context: int) -> int:
    """The slots of a new cache for `max_len` without CUDA graphs: whole CACHE_BLOCK_SLOTS, within the context."""
    return max(max_len, min(-(-max_len // CACHE_BLOCK_SLOTS) * CACHE_BLOCK_SLOTS, max_context))


def causal_mask(prefix: int, n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[n, prefix + n] additive mask: every new token sees the prefix and the new tokens up to itself."""
    mask = torch.zeros(n, prefix + n, dtype=dtype, device=device)
    mask[:, prefix:] = torch.full((n, n), float("-inf"), dtype=dtype, device=device).triu(1)
    return mask
