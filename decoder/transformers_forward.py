"""The generic backend: any causal LM transformers runs, scoring token trees with the model's own forward.

The lean forward (decoder/model.py) covers the families it names; every other `AutoModelForCausalLM` runs here,
behind the same contract the engine, the drafters and the profiler use (`forward`, `prefill`, `new_cache`,
`cache_for`, a cache with `length`, `commit` and `truncate`). A tree is verified as transformers' own
assisted decoding verifies a chain: one forward over the cache with explicit `position_ids` (a node's depth
after the prefix) and a custom 4D attention mask (each node sees the prefix and its ancestors), which
transformers' mask builders pass through unchanged (masking_utils: "If the mask is already 4D, simply return
as-is"). The cache is transformers' `DynamicCache` of full-attention layers; after each verification it keeps
the prefix and the accepted path only.

Slower than the lean forward (the cache grows by concatenation, no packed weights, no CUDA graphs), lossless
all the same. Refused here, in one line: models with sliding-window attention (one 4D mask cannot be full for
some layers and windowed for others; the lean forward runs Mistral, Qwen2/3, Phi-3 and Gemma windows), and any
model whose forward does not honour the mask and the positions, which `check_tree_attention` probes at load.
TriForce's retrieval cache and StreamingLLM window edit the lean cache's tensors and need the lean forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from specplan.core.errors import UserError
from specplan.decoder.model import ModelShape, causal_mask, draft_vocabulary_ids, prefill_in_chunks

PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}  # a probe row's max logit error


class TransformersCache:
    """The decoder's cache over a transformers DynamicCache: `length` committed tokens, then the slots the last
    forward wrote (dropped by the next forward, or kept in part by `commit`)."""

    def __init__(self, max_len: int) -> None:
        from transformers import DynamicCache

        self.dynamic = DynamicCache()  # no config: every layer a full-attention DynamicLayer
        self.max_len = max_len
        self.length = 0

    def written(self) -> int:
        return self.dynamic.get_seq_length()

    def drop_uncommitted(self) -> None:
        """Forget the slots after `length`: the next forward writes its tokens there."""
        if self.written() > self.length:
            for layer in self.dynamic.layers:
                layer.keys = layer.keys[..., :self.length, :]
                layer.values = layer.values[..., :self.length, :]

    def commit(self, kept: torch.Tensor | None, count: int) -> None:
        """Keep `count` of the slots written after the prefix: `kept` lists them (offsets from `length`,
        increasing), or None when they are the first `count`."""
        start = self.length
        if kept is not None:
            layers = self.dynamic.layers
            order = torch.cat([torch.arange(start), kept.cpu() + start]).to(layers[0].keys.device)
            for layer in layers:
                layer.keys = layer.keys.index_select(-2, order)
                layer.values = layer.values.index_select(-2, order)
        self.length = start + count

    def truncate(self, length: int) -> None:
        self.length = length


class TransformersForward:
    """A transformers model behind the lean forward's contract (decoder/model.py: LeanModel)."""

    backend = "transformers"
    graphed = None  # the lean forward's CUDA graphs (decoder/cuda_graphs.py) do not apply to transformers' own

    def __init__(self, hf_model: Any, device: torch.device | str = "cpu", vocabulary: int | None = None,
                 always: Iterable[int] = ()) -> None:
        """`vocabulary`, `always`: see limit_vocabulary."""
        config = hf_model.config
        parameters = inspect.signature(hf_model.forward).parameters
        if "position_ids" not in parameters:
            raise UserError(f"architecture {config.model_type!r} takes no position ids: the transformers backend "
                            "cannot place a token tree's nodes (and the lean decoder does not run it)")
        window = getattr(config, "sliding_window", None)
        if window is not None and getattr(config, "use_sliding_window", True):
            raise UserError(f"architecture {config.model_type!r} uses sliding-window attention, which the "
                            "transformers backend cannot mask per layer")
        self.model = hf_model.to(device).eval()
        self.config = config
        self.shape = ModelShape.from_config(config)
        self.device = torch.device(device)
        self.dtype = next(hf_model.parameters()).dtype
        self.output_ids: torch.Tensor | None = None
        self.keeps_rows = "logits_to_keep" in parameters
        # transformers 5.24 renamed `past_key_values` to `cache` (the old name is deprecated)
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        check_tree_attention(self)
        if vocabulary is not None:
            self.limit_vocabulary(vocabulary, always)

    def limit_vocabulary(self, size: int, always: Iterable[int] = ()) -> None:
        """Score only the ids below `size` plus `always` (the stop tokens): the others get -inf, so that a draft
        drafts as it was measured; here it saves no time (the model's head scores every id)."""
        if self.output_ids is not None:
            raise UserError("the vocabulary of this model is already limited")
        self.output_ids = torch.tensor(draft_vocabulary_ids(size, always, self.shape.vocab), device=self.device)

    def new_cache(self, max_len: int) -> TransformersCache:
        if max_len > self.shape.max_context:
            raise UserError(f"a cache of {max_len} tokens exceeds the model's maximum context {self.shape.max_context}")
        return TransformersCache(max_len)

    def cache_for(self, max_len: int, role: str, exact: bool = False, keep: bool = False) -> TransformersCache:
        """A new cache each time: nothing is kept for a role here (`keep` asks for nothing more)."""
        return self.new_cache(max_len)

    def prefill(self, tokens: torch.Tensor, cache: TransformersCache, chunk: int = 512, logits: bool = True,
                prompt_length: int | None = None) -> torch.Tensor | None:
        """Append `tokens` to the cache in causal chunks; the last token's logits ([vocab]) if asked.
        (`prompt_length` is the lean forward's; transformers' own RoPE needs only the positions.)"""
        return prefill_in_chunks(self, tokens, cache, chunk, logits)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: TransformersCache,
                mask: torch.Tensor | None, logits_rows: torch.Tensor | slice | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """Score `tokens` ([n]) at `positions` ([n]) after the cache's `length` tokens, `mask` an additive
        [n, length + n] mask (None: each new token sees everything before it, as for n = 1); logits [rows, vocab]
        for `logits_rows` (all by default). The new tokens' keys stay in the cache until the next forward."""
        if slots is not None:
            raise UserError("the static cache layout (CUDA graphs) is the lean decoder's; this model runs on the "
                            "transformers backend")
        n = tokens.shape[0]
        cache.drop_uncommitted()
        if cache.length + n > cache.max_len:
            raise UserError(f"{cache.length + n} tokens do not fit the {cache.max_len}-token cache")
        if mask is None and n > 1:
            mask = causal_mask(cache.length, n, self.dtype, self.device)
        attention = None if mask is None else _additive(mask.to(self.device, self.dtype))[None, None]
        rows = _row_indices(logits_rows, n)
        keep: dict[str, Any] = {}
        if self.keeps_rows and rows is not None:
            keep["logits_to_keep"] = rows.to(self.device) if len(rows) else 1
        out = self.model(input_ids=tokens.to(self.device)[None], position_ids=positions.to(self.device)[None],
                         attention_mask=attention, use_cache=True, **{self.cache_argument: cache.dynamic},
                         cache_position=torch.arange(cache.length, cache.length + n, device=self.device), **keep)
        logits = out.logits[0]
        if rows is not None:
            logits = logits[:0] if not len(rows) else (logits if keep else logits[rows.to(self.device)])
        if self.output_ids is None:
            return logits
        limited = torch.full_like(logits, float("-inf"))
        limited[:, self.output_ids] = logits[:, self.output_ids]
        return limited


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """The decoder's -inf entries as the dtype's minimum, the value transformers' own float masks hold (an eager
    attention's softmax over a row of -inf and a large negative score stays finite either way)."""
    return mask.masked_fill(torch.isinf(mask), torch.finfo(mask.dtype).min)


def _row_indices(rows: torch.Tensor | slice | None, n: int) -> torch.Tensor | None:
    if rows is None:
        return None
    if isinstance(rows, slice):
        return torch.arange(n)[rows]
    return rows.cpu()


@torch.inference_mode()
def check_tree_attention(model: TransformersForward) -> None:
    """Refuse a model that does not verify a tree: two siblings scored in one forward under a tree mask must each
    get the logits of their own root path, and the second must not see the first."""
    a, b, c = (torch.tensor([token]) for token in torch.randint(0, model.shape.vocab, (3,),
                                                                generator=torch.Generator().manual_seed(0)))
    tree = model.new_cache(4)
    mask = causal_mask(0, 3, model.dtype, model.device)
    mask[2, 1] = float("-inf")  # c is a's child beside b, at b's position
    try:
        both = model.forward(torch.cat([a, b, c]), torch.tensor([0, 1, 1]), tree, mask)
        alone = model.forward(torch.cat([a, c]), torch.tensor([0, 1]), model.new_cache(2), None)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise UserError(f"architecture {model.config.model_type!r} cannot score a token tree through "
                        f"transformers ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                        ) from None
    error = (both[2].float() - alone[1].float()).abs().max().item()
    if not error <= PROBE_TOLERANCE.get(model.dtype, 1e-2) * max(1.0, alone[1].float().abs().max().item()):
        raise UserError(f"architecture {model.config.model_type!r} ignores a custom 4D attention mask or explicit "
                        f"position ids (a tree node's logits differ from its path's by {error:.3g}): the "
                        "transformers backend cannot verify token trees with it")
