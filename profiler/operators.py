"""Operators the decoder's forward dispatches, counted (not guessed): what a modeled GPU forward pays a kernel for
each (profiler/roofline.py), and what the CPU model pays per-operator overhead for."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specplan.core.errors import UserError
from specplan.core.models import TORCH_DTYPES
from specplan.decoder.model import ForwardItem, LeanModel, causal_mask, cuda_grouped_attention

# A GPU forward's attention path for each probe (n new tokens over L keys): one row, grouped matmuls, masked SDPA
# (decoder/model.py: cuda_grouped_attention picks between the last two)
PATH_PROBES = {"single": (1, 64), "grouped": (2, 4096), "masked": (65, 64)}
SHRUNK_SIZES = {"hidden_size": 128, "intermediate_size": 128, "vocab_size": 256}


class _OperatorCounter(TorchDispatchMode):
    """Counts the operators that run a kernel (views and detaches launch none)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__ != "detach.default":
            self.count += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def count_forward(model: LeanModel, n: int, context: int, static: bool, sequences: int = 1) -> int:
    """Operators one forward of n tokens after `context` cached ones dispatches (static layout: the graphs'); with
    `sequences` > 1, one batched forward of that many such sequences, each over its own cache."""
    items, slots = [], []
    for _ in range(sequences):
        cache = model.new_cache(context + n)
        cache.length = context
        positions = torch.arange(context, context + n)
        mask = causal_mask(context, n, model.dtype, model.device) if n > 1 or static else None
        items.append(ForwardItem(torch.zeros(n, dtype=torch.long), positions, cache, mask))
        slots.append(positions.clone())
    counter = _OperatorCounter()
    with counter:
        if sequences > 1:
            model._forward_operators(items, slots if static else None)
        elif static:
            model.forward(*items[0], slots=slots[0])
        else:
            model.forward(*items[0])
    return counter.count


@dataclass(frozen=True)
class OperatorCounts:
    """Kernels a GPU forward launches by attention path ({single, grouped, masked}: PATH_PROBES): `forward` for one
    sequence; a batched step of B sequences launches `batching` more (joining and splitting their rows) and
    `sequence` more for each sequence after the first (its cache writes and attention run apart: decoder/model.py,
    LeanModel._forward_operators)."""

    forward: dict[str, int]
    sequence: dict[str, int]
    batching: dict[str, int]

    def batched(self, path: str, batch: int) -> int:
        if batch == 1:
            return self.forward[path]
        return self.forward[path] + self.batching[path] + (batch - 1) * self.sequence[path]


def _shrunk(config: Any, layers: int) -> Any:
    """The config with `layers` layers and small matrices: the same operators per layer, built in milliseconds."""
    small = copy.deepcopy(config)
    for key, value in SHRUNK_SIZES.items():
        setattr(small, key, value)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    small.num_attention_heads = 2
    small.num_key_value_heads = 1 if kv_heads < heads else 2
    small.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # RoPE tables keep their size
    small.num_hidden_layers = layers
    small.max_position_embeddings = max(config.max_position_embeddings, max(n + L for n, L in PATH_PROBES.values()))
    if getattr(small, "layer_types", None):
        small.layer_types = list(small.layer_types[:layers])
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if hasattr(small, key):
            setattr(small, key, None)
    return small


def gpu_operators(config: Any, dtype: str) -> OperatorCounts:
    """Operators per forward on each GPU attention path, alone and per further sequence of a batched step, counted
    on a one- and a two-layer copy of `config` run on the CPU with the GPU's choice of attention path."""
    from transformers import AutoModelForCausalLM

    torch_dtype = TORCH_DTYPES["bf16" if dtype == "fp16" else dtype]
    fp32 = torch_dtype == torch.float32

    def gpu_path(n: int, keys: int) -> bool:
        return cuda_grouped_attention(n, keys, fp32)

    counts: dict[tuple[int, int], dict[str, int]] = {}  # by (layers, sequences)
    for layers in (1, 2):
        try:
            with torch.device("cpu"):
                hf = AutoModelForCausalLM.from_config(_shrunk(config, layers), dtype=torch_dtype)
            model = LeanModel(hf, "cpu", kernels=False)
        except UserError:
            raise
        except Exception as error:  # a config transformers or the lean decoder cannot build
            raise UserError(f"cannot model a {config.model_type} config: {str(error).splitlines()[0]}") from None
        model._grouped_attention = gpu_path  # the GPU's choice of attention path, on the CPU
        for sequences in (1, 2, 3):
            counts[layers, sequences] = {path: count_forward(model, n, context, static=True, sequences=sequences)
                                         for path, (n, context) in PATH_PROBES.items()}

    def at_depth(sequences: int) -> dict[str, int]:
        one, two = counts[1, sequences], counts[2, sequences]
        return {path: one[path] + (two[path] - one[path]) * (config.num_hidden_layers - 1) for path in PATH_PROBES}

    alone, two, three = at_depth(1), at_depth(2), at_depth(3)
    sequence = {path: three[path] - two[path] for path in PATH_PROBES}
    return OperatorCounts(alone, sequence, {path: two[path] - alone[path] - sequence[path] for path in PATH_PROBES})
