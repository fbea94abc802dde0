"""Rotary position embeddings: the cos/sin tables of every RoPE variant transformers' configs describe.

The inverse frequencies come from transformers' own `ROPE_INIT_FUNCTIONS` (linear, dynamic NTK, yarn, longrope,
llama3), so every variant's arithmetic is the one its checkpoints were trained and evaluated with; `default` is
1 / theta^(2i / dim). cos and sin are scaled by the variant's attention factor (yarn, longrope) and computed in
fp32, then cast to the model's dtype, as transformers does. Only the first `rotary_dim` dimensions of a head
rotate (`partial_rotary_factor`, Phi-3 style).

Two variants make the frequencies depend on the sequence length, which transformers takes per forward as
s = max(position ids) + 1: dynamic NTK rescales theta once s passes `max_position_embeddings`, and longrope
switches from its short to its long factors once s passes `original_max_position_embeddings`. A speculative
step scores tokens of several positions in one forward, so the lean decoder fixes s per token the way the
target's own decoding (transformers' `generate`: the prompt in one forward, then one token per forward) sees it:

    s(token at position p) = max(p + 1, prompt length).

Greedy speculative output then equals the target's own greedy output token for token. Phi-3's generate goes
further: when the sequence first outgrows the original context it re-encodes every token with the long factors
(decoder/model.py does the same, `Architecture.reencodes_long_rope`). (transformers' dynamic
NTK also keeps its largest s between calls of the same model object until a short sequence resets it; this
decoder is stateless: every generation starts from the rule above.)
"""

from __future__ import annotations

from typing import Any

import torch

POSITION_DEPENDENT = ("dynamic", "longrope")  # RoPE variants whose frequencies depend on the sequence length


def rope_parameters(config: Any, layer_type: str | None) -> dict[str, Any]:
    """The RoPE parameters of one layer type (Gemma 3 gives each its own) or of the model."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(parameters.get(layer_type), dict):
        return parameters[layer_type]
    return parameters


class RotaryTables:
    """cos/sin [n, rotary_dim] for the positions of a forward, for one RoPE parameter set."""

    def __init__(self, config: Any, layer_type: str | None, head_dim: int, max_context: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        parameters = rope_parameters(config, layer_type)
        self.kind = parameters.get("rope_type", "default")
        self.config, self.layer_type, self.dtype, self.device = config, layer_type, dtype, device
        self.rotary_dim = int(head_dim * parameters.get("partial_rotary_factor", 1.0))
        self.max_position = config.max_position_embeddings
        self.original_max_position = parameters.get("original_max_position_embeddings", self.max_position)
        inv_freq, self.scaling = self._inverse_frequencies(None)
        positions = torch.arange(max_context, device=device)
        self.cos, self.sin = self._rotate(positions, inv_freq)
        self.long = None
        if self.kind == "longrope":
            long_freq, _ = self._inverse_frequencies(self.original_max_position + 1)
            self.long = self._rotate(positions, long_freq)
        self._dynamic: dict[int, torch.Tensor] = {}  # dynamic NTK: inverse frequencies per sequence length

    @property
    def position_dependent(self) -> bool:
        return self.kind in POSITION_DEPENDENT

    def _inverse_frequencies(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        if self.kind == "default":
            theta = float(rope_parameters(self.config, self.layer_type).get(
                "rope_theta", getattr(self.config, "rope_theta", 10000.0)))
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=self.device).float()
            return 1.0 / (theta ** (exponents / self.rotary_dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        initialize = ROPE_INIT_FUNCTIONS[self.kind]
        length = None if seq_len is None else torch.tensor(seq_len, device=self.device)
        if self.layer_type is None:
            return initialize(self.config, self.device, seq_len=length)
        return initialize(self.config, self.device, seq_len=length, layer_type=self.layer_type)

    def _rotate(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * inv_freq.float().to(positions.device)[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self.scaling).to(self.dtype), (angles.sin() * self.scaling).to(self.dtype)

    def __call__(self, positions: torch.Tensor, prompt_length: int = 0, long_context: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, rotary_dim] for `positions` ([n]) of a generation whose prompt has `prompt_length` tokens;
        `long_context`: longrope's long factors for every position (Phi-3, once its sequence is long)."""
        if not self.position_dependent:
            return self.cos[positions], self.sin[positions]
        lengths = torch.clamp(positions + 1, min=prompt_length)
        if self.long is not None:
            beyond = ((lengths > self.original_max_position) | long_context)[:, None]
            return (torch.where(beyond, self.long[0][positions], self.cos[positions]),
                    torch.where(beyond, self.long[1][positions], self.sin[positions]))
        cos, sin = self.cos[positions].clone(), self.sin[positions].clone()
        for length in torch.unique(lengths[lengths > self.max_position]).tolist():
            if length not in self._dynamic:
                if len(self._dynamic) > 4096:
                    self._dynamic.clear()
                self._dynamic[length] = self._inverse_frequencies(length)[0]
            rows = lengths == length
            cos[rows], sin[rows] = self._rotate(positions[rows], self._dynamic[length])
        return cos, sin
