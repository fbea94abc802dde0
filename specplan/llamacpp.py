"""llama.cpp as a baseline (`plan bench --baselines llama.cpp,llama.cpp-lookup`, bench/llamacpp_forward.py).

llama.cpp runs the GGUF file our decoder loads, through llama-cpp-python (the optional extra `llamacpp`, built
from source for this CPU by `make bench-setup`), on as many threads as torch uses. At dtype gguf it runs the
file as shipped; at fp32 or bf16 the file converted to F32 or BF16 by llama.cpp's own quantize tool (the
dequantized weights: the values our fp32 model holds, rounded to bf16 the same way for bf16). It decodes one
token per forward (`llama.cpp`) or with its prompt lookup (`llama.cpp-lookup`, LlamaPromptLookupDecoding).
Its greedy output need not equal transformers': at dtype gguf llama.cpp rounds activations to 8-bit blocks.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from core.errors import UserError
from core.models import LoadedModel, cache_dir
from decoder.sampling import SamplingParams

# llama.cpp's file types (llama.h: LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_BF16) for our dtypes; gguf: as shipped
FILE_TYPES = {"fp32": ("F32", 0), "bf16": ("BF16", 32)}
CONTEXT_MARGIN = 64  # tokens of context beyond prompt + new tokens (llama.cpp's lookup drafts past the end)


def llama_cpp() -> ModuleType:
    try:
        import llama_cpp as module
    except ImportError:
        raise UserError("the llama.cpp baselines need llama-cpp-python: pip install '.[llamacpp]' "
                        "(or make bench-setup)") from None
    return module


def gguf_for(loaded: LoadedModel) -> Path:
    """The GGUF llama.cpp runs for `loaded` at its dtype (converted once and cached)."""
    source = loaded.gguf_file()
    if source is None:
        raise UserError(f"{loaded.name}: the llama.cpp baselines run a GGUF file; this model has none "
                        "(a preset or a .gguf file has)")
    if loaded.dtype == "gguf":
        return source
    kind, file_type = FILE_TYPES[loaded.dtype]
    target = cache_dir() / "llamacpp" / f"{source.stem}.{kind}.gguf"
    if not target.is_file():
        module = llama_cpp()
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.close(fd)
        try:
            params = module.llama_model_quantize_default_params()
            params.ftype = file_type
            params.allow_requantize = True
            if module.llama_model_quantize(str(source).encode(), staging.encode(), ctypes.byref(params)) != 0:
                raise UserError(f"llama.cpp could not convert {source.name} to {kind}")
            os.replace(staging, target)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
    return target


class LlamaCpp:
    """One llama.cpp model: a greedy or sampled generation from token ids, timed as our engine's decoding is."""

    def __init__(self, loaded: LoadedModel, context: int, lookup_tokens: int | None = None) -> None:
        module = llama_cpp()
        draft = None
        if lookup_tokens is not None:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
        threads = torch.get_num_threads()
        self.path = gguf_for(loaded)
        # a draft needs every position's logits; llama-cpp-python sizes its logits buffer by logits_all alone
        self.model = module.Llama(model_path=str(self.path), n_ctx=context + CONTEXT_MARGIN, n_threads=threads,
                                  n_threads_batch=threads, n_batch=512, draft_model=draft,
                                  logits_all=draft is not None, verbose=False)
        self.stop_ids = loaded.stop_token_ids

    def generate(self, ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int
                 ) -> tuple[list[int], dict[str, Any]]:
        """New tokens after `ids`, and the decode count and time: the tokens after the first (which the prompt's
        forward yields) over the time after it, as transformers' baselines are timed."""
        self.model.set_seed(seed)
        sampling: dict[str, Any] = {"temp": 0.0} if params.greedy else {
            "temp": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
        tokens: list[int] = []
        first = 0.0
        for token in self.model.generate(ids, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True,
                                         **sampling):
            if not tokens:
                first = time.perf_counter()
            tokens.append(int(token))
            if token in self.stop_ids or len(tokens) >= max_new_tokens:
                break
        decode = (len(tokens) - 1, time.perf_counter() - first) if tokens else (0, 0.0)
        return tokens, {"decode": decode}
