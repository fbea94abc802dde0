"""llama.cpp as a baseline (`plan bench --baselines llama.cpp,llama.cpp-lookup`, bench/llamacpp_forward.py), and its
own t(n) (`plan profile --engine llama.cpp`, what plans for llama.cpp's prompt lookup are priced on).

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from specplan.core.acceptance_schema import DRAFT_SAMPLER_TOP_K
from specplan.core.errors import UserError
from specplan.core.method_settings import PromptLookupSettings
from specplan.core.models import LoadedModel, cache_dir, load_model
from specplan.decoder.sampling import SamplingParams
from specplan.profiler import hardware
from specplan.profiler.latency import ProfileRequest, profile_document

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


def open_llama(loaded: LoadedModel, context: int, draft: Any = None, logits_all: bool = False) -> Any:
    """llama.cpp over `loaded`'s GGUF at its dtype, on torch's threads, with room for `context` tokens."""
    threads = torch.get_num_threads()
    return llama_cpp().Llama(model_path=str(gguf_for(loaded)), n_ctx=context + CONTEXT_MARGIN, n_threads=threads,
                             n_threads_batch=threads, n_batch=512, draft_model=draft, logits_all=logits_all,
                             verbose=False)


def forward_after(llama: Any, context: int, tokens: list[int]) -> None:
    """One llama.cpp forward of `tokens` after the first `context` tokens of its cache, the rest of the cache
    dropped first (as a rejected draft's entries are)."""
    llama._ctx.kv_cache_seq_rm(-1, context, -1)
    llama.n_tokens = context
    llama.eval(tokens)


def profile_llamacpp(request: ProfileRequest, log: Callable[[str], None]) -> dict[str, Any]:
    """A measured profile of llama.cpp's own forward: t(n, L) of a forward of n tokens after L, every row's logits
    kept (logits_all, as its prompt lookup and its draft-model verification run), median and p10/p90 of the repeats,
    on random token ids; with a draft, the draft's one-token step after L as well (what llama.cpp's draft-model
    speculation runs per drafted token)."""
    if request.gpu is not None or request.draft_vocab is not None:
        raise UserError("--engine llama.cpp times llama.cpp's forward on this CPU, the draft's whole vocabulary: no "
                        "--gpu, no --draft-vocab")
    torch.set_num_threads(request.threads)
    loaded = {"target": load_model(request.target, request.dtype)}
    if request.draft is not None:
        loaded["draft"] = load_model(request.draft, request.draft_dtype or request.dtype)
    longest = max(request.contexts) + max(request.sizes)
    sizes = {"target": request.sizes, "draft": [1]}
    generator = torch.Generator().manual_seed(0)
    vocabulary = min(model.config.vocab_size for model in loaded.values())
    ids = torch.randint(100, min(vocabulary, 30000), (longest,), generator=generator).tolist()
    curves: dict[str, dict[int, dict[int, dict[str, float]]]] = {}
    prefills: dict[str, dict[int, float]] = {}  # {role: {prompt length: seconds}}
    started = time.perf_counter()
    for role, model in loaded.items():
        llama = open_llama(model, longest, logits_all=role == "target")
        curves[role] = {}
        for context in request.contexts:
            llama.reset()
            start = time.perf_counter()
            llama.eval(ids[:context])
            prefills.setdefault(role, {})[context] = time.perf_counter() - start
            curves[role][context] = {n: _timed(llama, context, ids[context:context + n], request.warmup,
                                               request.repeats) for n in sizes[role]}
            log(f"llama.cpp {role} t(n) at L={context}: " + ", ".join(
                f"{n}: {p['median'] * 1e3:.2f} ms" for n, p in curves[role][context].items()))
        del llama
    machine = hardware.fingerprint(torch.device("cpu"), request.dtype, request.threads)
    document = profile_document(request, "measured", machine, loaded, curves)
    for role, seconds in prefills.items():
        document[role]["prefill_seconds"] = seconds
    document["backend"] = "llama.cpp"
    document["settings"] = {"engine": f"llama.cpp (llama-cpp-python {llama_cpp().__version__})",
                            "gguf": gguf_for(loaded["target"]).name, "threads": request.threads,
                            "warmup": request.warmup, "repeats": request.repeats, "logits_all": True,
                            **({"draft_gguf": gguf_for(loaded["draft"]).name} if "draft" in loaded else {})}
    document["measurement_seconds"] = round(time.perf_counter() - started, 1)
    return document


def _timed(llama: Any, context: int, new: list[int], warmup: int, repeats: int) -> dict[str, float]:
    """p10, median and p90 seconds of a forward of `new` after `context` tokens."""
    for _ in range(warmup):
        forward_after(llama, context, new)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward_after(llama, context, new)
        times.append(time.perf_counter() - start)
    quantiles = np.quantile(times, [0.1, 0.5, 0.9])
    return {"p10": quantiles[0], "median": quantiles[1], "p90": quantiles[2]}


@dataclass(frozen=True)
class DraftChainSettings:
    """llama.cpp's draft-model speculation: the draft and its --draft-max/--draft-min/--draft-p-min."""

    draft: LoadedModel
    draft_max: int
    draft_min: int = 0
    p_min: float = 0.0


class DraftModelChain:
    """llama-server's draft-model drafting rule (common/speculative.cpp, draft-simple; planner/engines.py cites it)
    behind llama-cpp-python's draft-model interface (a callable from the token ids so far to the drafted ids): the
    draft catches up on the tokens its cache lacks, then drafts its sampler's top candidate (probability over the top
    DRAFT_SAMPLER_TOP_K) up to draft_max tokens, stopping before one below p_min; a draft shorter than draft_min
    is dropped."""

    def __init__(self, settings: DraftChainSettings, context: int) -> None:
        self.settings = settings
        self.llama = open_llama(settings.draft, context)
        self.cached: list[int] = []

    def __call__(self, input_ids: np.ndarray) -> np.ndarray:
        ids = input_ids.tolist()
        common = 0
        limit = min(len(self.cached), len(ids) - 1)  # the last token is always evaluated: its logits are needed
        while common < limit and self.cached[common] == ids[common]:
            common += 1
        if common < len(ids) - 1:  # llama.cpp decodes the tokens its draft lacks, then the last one alone
            forward_after(self.llama, common, ids[common:-1])
        forward_after(self.llama, len(ids) - 1, ids[-1:])
        self.cached = ids
        drafted: list[int] = []
        while True:
            logits = np.ctypeslib.as_array(self.llama._ctx.get_logits(), shape=(self.llama.n_vocab(),))
            top = np.sort(np.partition(logits, -DRAFT_SAMPLER_TOP_K)[-DRAFT_SAMPLER_TOP_K:])[::-1]
            if 1.0 / np.exp(top - top[0]).sum() < self.settings.p_min:
                break
            drafted.append(int(np.argmax(logits)))
            if len(drafted) >= self.settings.draft_max:
                break
            forward_after(self.llama, len(self.cached), drafted[-1:])
            self.cached = self.cached + drafted[-1:]
        return np.array(drafted if len(drafted) >= self.settings.draft_min else [], dtype=np.intc)


class LlamaCpp:
    """One llama.cpp model: a greedy or sampled generation from token ids, timed as our engine's decoding is."""

    def __init__(self, loaded: LoadedModel, context: int, lookup: PromptLookupSettings | None = None,
                 draft_chain: DraftChainSettings | None = None) -> None:
        llama_cpp()  # the extra first: without it, that is the error to give
        draft = None
        if lookup is not None:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(max_ngram_size=lookup.max_ngram, num_pred_tokens=lookup.num_tokens)
        elif draft_chain is not None:
            draft = DraftModelChain(draft_chain, context)
        self.path = gguf_for(loaded)
        # a draft needs every position's logits; llama-cpp-python sizes its logits buffer by logits_all alone
        self.model = open_llama(loaded, context, draft, logits_all=draft is not None)
        self.stop_ids = loaded.stop_token_ids
        self.forwards = 0
        evaluate = self.model.eval

        def counted(tokens: Any) -> None:  # llama-cpp-python's generate calls eval once per forward
            self.forwards += 1
            evaluate(tokens)

        self.model.eval = counted

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
                self.forwards = 0
            tokens.append(int(token))
            if token in self.stop_ids or len(tokens) >= max_new_tokens:
                break
        decode = (len(tokens) - 1, time.perf_counter() - first) if tokens else (0, 0.0)
        # the forwards after the prompt's (the generator's last forward, for a token not taken, is not started)
        return tokens, {"decode": decode, "decode_forwards": self.forwards}


def greedy_outputs(loaded: LoadedModel, context: int) -> tuple[Callable[[list[int], int], list[int]], str]:
    """llama.cpp's greedy decoding of `loaded`, one token per forward (`plan accept lookahead --engine llama.cpp`:
    the text llama.cpp's prompt lookup runs on, at a dtype where llama.cpp's output differs from ours)."""
    runner = LlamaCpp(loaded, context)

    def generate(ids: list[int], budget: int) -> list[int]:
        return runner.generate(ids, budget, SamplingParams(), 0)[0]

    return generate, f"llama.cpp ({runner.path.name})"
