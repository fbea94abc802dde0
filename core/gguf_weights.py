"""Matmul weights in GGUF block formats, as a GGUF file ships them (`--dtype gguf`).

A model at dtype `gguf` keeps each matmul weight in the file's own quantized blocks (Q4_1, Q4_K, Q6_K, ...) and
the decoder's CPU kernels decode them block by block inside the matmul (decoder/kernels/cpu_kernels.cpp); norms,
biases and activations stay fp32, read from the converted checkpoint as at dtype fp32. Blocks decode to exactly
the values the fp32 model dequantized from the same file; matmuls over Q4_K and Q6_K blocks round their input to
8-bit blocks of 256 first (llama.cpp's Q8_K), the others take it in fp32 (README: "How this model differs from
the dequantized one").

`read_gguf` reads a GGUF file's scalar metadata and tensor table (the data stays memory-mapped); `read_block_weights`
maps a GGUF's tensors to transformers' parameter names (undoing llama.cpp's reordering of
Llama's q/k rows, as transformers' GGUF loader does); `quantize_block_weights` quantizes a model's own weights
with llama.cpp's Q4_1/Q8_0 rules (gguf-py), which gives the tiny test models a dtype `gguf` too.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from specplan.core.errors import UserError

# The GGML types the CPU kernels decode, by GGML's names (gguf-py's GGMLQuantizationType holds their ids; the
# kernels' own list is held equal to this one by tests/test_cpu_kernels.py)
BLOCK_FORMATS = ("F32", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# GGUF tensor names of the matmul weights of a decoder layer, and transformers' names for them
LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
# The tiny test models at dtype gguf: the smollm2 preset's mix (Q4_1 layers, Q8_0 embedding)
TEST_LAYER_FORMAT, TEST_EMBEDDING_FORMAT = "Q4_1", "Q8_0"


@dataclass(frozen=True)
class BlockWeight:
    """A [rows, cols] matrix in a GGUF block format: `data` is uint8 [rows, bytes per row], each row's blocks as
    the file stores them."""

    format: str
    rows: int
    cols: int
    data: torch.Tensor

    def take_rows(self, rows: torch.Tensor) -> BlockWeight:
        return BlockWeight(self.format, int(rows.numel()), self.cols, self.data[rows].contiguous())


# struct codes of GGUF's fixed-size metadata values (little-endian files)
_SCALAR_CODES = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
                 GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
                 GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
                 GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGML's order: the length of a row first
    data: np.ndarray  # uint8, the tensor's bytes, memory-mapped

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def take(self, code: str) -> Any:
        value = struct.unpack_from("<" + code, self.buffer, self.offset)[0]
        self.offset += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.take("Q")
        start, self.offset = self.offset, self.offset + length
        if self.offset > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        return self.buffer[start:self.offset].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        """A metadata value; an array is read past and returned as None (only scalars and strings are kept)."""
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item in _SCALAR_CODES:
                self.offset += count * struct.calcsize(_SCALAR_CODES[GGUFValueType(item)])
            else:
                for _ in range(count):
                    self.value(item)
            return None
        return self.take(_SCALAR_CODES[GGUFValueType(kind)])


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """A GGUF file's scalar and string metadata, and its tensors by name. gguf-py's GGUFReader builds every
    metadata array item by item, seconds for a tokenizer's vocabulary; this reads past the arrays."""
    try:
        with open(path, "rb") as handle:
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # an empty file
        raise UserError(f"{path}: not a GGUF file (empty)") from None
    except OSError as exc:
        raise UserError(f"{path}: not a readable GGUF file ({exc})") from None
    try:
        cursor = _Cursor(buffer)
        if cursor.take("I") != GGUF_MAGIC:
            raise UserError(f"{path}: not a GGUF file (no GGUF magic)")
        version = cursor.take("I")
        if version not in (2, 3):
            raise UserError(f"{path}: GGUF version {version} (big-endian or unsupported); 2 and 3 are read")
        tensor_count, field_count = cursor.take("Q"), cursor.take("Q")
        fields = {}
        for _ in range(field_count):
            key = cursor.string()
            fields[key] = cursor.value(cursor.take("I"))
        table = []
        for _ in range(tensor_count):
            name = cursor.string()
            shape = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
            table.append((name, GGMLQuantizationType(cursor.take("I")), shape, cursor.take("Q")))
        alignment = int(fields.get("general.alignment") or GGUF_DEFAULT_ALIGNMENT)
        start = -(-cursor.offset // alignment) * alignment
        tensors = {}
        for name, kind, shape, offset in table:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            size = int(np.prod(shape)) // block * block_bytes
            if start + offset + size > len(buffer):
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = np.frombuffer(buffer, np.uint8, size, start + offset)
            tensors[name] = GGUFTensor(name, kind, shape, data)
        return fields, tensors
    except (struct.error, ValueError, KeyError) as exc:
        raise UserError(f"{path}: not a readable GGUF file ({exc})") from None


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows reordered for its rotary layout (convert_hf_to_gguf.py: permute); the
    index of the stored row that holds each of transformers' rows (transformers' _reverse_permute_weights)."""
    index = np.arange(rows).reshape(heads, rows // heads // 2, 2)
    return index.swapaxes(2, 1).reshape(rows)


def read_block_weights(path: Path, config: Any) -> dict[str, BlockWeight]:
    """The matmul weights of a GGUF file, by transformers parameter name, in the blocks the file stores."""
    fields, tensors = read_gguf(path)
    architecture = str(fields.get("general.architecture"))
    names = {"token_embd": "model.embed_tokens", "output": "lm_head"}
    for i in range(config.num_hidden_layers):
        names.update({f"blk.{i}.{short}": f"model.layers.{i}.{long}" for short, long in LAYER_TENSORS.items()})
    weights = {}
    for short, long in names.items():
        tensor = tensors.get(short + ".weight")
        if tensor is None:
            if short == "output":  # tied to the embedding
                continue
            raise UserError(f"{path.name}: no tensor {short}.weight; its {architecture} layout is not one dtype gguf "
                            f"reads (it reads {', '.join(LAYER_TENSORS)} per layer)")
        kind = tensor.type.name
        if kind not in BLOCK_FORMATS:
            raise UserError(f"{path.name}: {short}.weight is {kind}, a quantization type the CPU kernels do not run "
                            f"(they run {', '.join(BLOCK_FORMATS)})")
        cols, rows = (int(size) for size in tensor.shape[:2])
        data = tensor.data.reshape(rows, -1)
        if architecture == "llama" and short.endswith(("attn_q", "attn_k")):
            heads = config.num_attention_heads if short.endswith("attn_q") else config.num_key_value_heads
            data = data[_unpermute_rows(rows, heads)]
        weights[long + ".weight"] = BlockWeight(kind, rows, cols, torch.from_numpy(np.array(data)))
    return weights


def quantize_block_weights(model: Any) -> dict[str, BlockWeight]:
    """A model's matmul weights quantized with llama.cpp's rules (gguf-py): Q4_1 layers, a Q8_0 embedding; the
    model's own weights are set to the blocks' values, as a GGUF's converted checkpoint holds them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    weights = {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.endswith(".weight") or parameter.dim() != 2:
                continue
            embedding = name in ("model.embed_tokens.weight", "lm_head.weight")
            kind = TEST_EMBEDDING_FORMAT if embedding else TEST_LAYER_FORMAT
            values = parameter.detach().float().numpy()
            blocks = quantize(values, GGMLQuantizationType[kind])
            weights[name] = BlockWeight(kind, values.shape[0], values.shape[1],
                                        torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8)))
            parameter.copy_(torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind])))
    return weights
