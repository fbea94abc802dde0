"""Operators the decoder's forward dispatches, counted (not guessed): what a modeled GPU forward pays a kernel for
each (profiler/roofline.py), and what the CPU model pays per-operator overhead for."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specplan.core.errors import UserError
from specplan.core.models import TORCH_DTYPES
from specplan.decoder.model import LeanModel, causal_mask, cuda_grouped_attention

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
def count_forward(model: LeanModel, n: int, context: int, static: bool) -> int:
    """Operators one forward of n tokens after `context` cached ones dispatches (static layout: the graphs')."""
    cache = model.new_cache(context + n)
    cache.length = context
    tokens, positions = torch.zeros(n, dtype=torch.long), torch.arange(context, context + n)
    mask = causal_mask(context, n, model.dtype, model.device) if n > 1 or static else None
    counter = _OperatorCounter()
    with counter:
        if static:
            model.forward(tokens, positions, cache, mask, slots=positions.clone())
        else:
            model.forward(tokens, positions, cache, mask)
    return counter.count


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


def gpu_operators(config: Any, dtype: str) -> dict[str, int]:
    """Operators per forward on each GPU attention path ({single, grouped, masked}: PATH_PROBES), counted on a
    one- and a two-layer copy of `config` run on the CPU with the GPU's choice of attention path."""
    from transformers import AutoModelForCausalLM

    torch_dtype = TORCH_DTYPES["bf16" if dtype == "fp16" else dtype]
    fp32 = torch_dtype == torch.float32

    def gpu_path(n: int, keys: int) -> bool:
        return cuda_grouped_attention(n, keys, fp32)

    counts: dict[int, dict[str, int]] = {}
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
        counts[layers] = {path: count_forward(model, n, context, static=True)
                          for path, (n, context) in PATH_PROBES.items()}
    per_layer = {path: counts[2][path] - counts[1][path] for path in PATH_PROBES}
    fixed = {path: counts[1][path] - per_layer[path] for path in PATH_PROBES}
    return {path: fixed[path] + per_layer[path] * config.num_hidden_layers for path in PATH_PROBES}
