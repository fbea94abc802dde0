"""The Python API: load a plan with its models, then generate.

    from decoder.api import load_decoder
    decoder = load_decoder("plans/qwen2.5-coder-1.5b.sequoia.cpu-2c.fp32.yaml")
    output = decoder.generate("Write a quicksort in Python.", max_new_tokens=128, chat=True)
    print(output.text, output.result.tokens_per_second)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.errors import UserError
from core.models import LoadedModel, check_same_vocabulary, load_model
from core.plan_schema import Plan, load_plan
from core.prompts import encode_prompt
from decoder.cuda_graphs import enable_cuda_graphs
from decoder.drafters import Drafter, NoDrafter, SequoiaDrafter, TrieDrafter
from decoder.engine import GenerationResult, SpeculativeEngine
from decoder.model import LeanModel
from decoder.sampling import SamplingParams
from decoder.trie import Trie


@dataclass
class GenerationOutput:
    result: GenerationResult
    text: str
    prompt_tokens: int

    def to_json(self) -> dict[str, Any]:
        result = self.result
        return {
            "tokens": result.tokens,
            "text": self.text,
            "tokens_per_step": result.tokens_per_step,
            "tokens_per_second": result.tokens_per_second,
            "prefill_seconds": result.prefill_seconds,
            "decode_seconds": result.decode_seconds,
            "steps": result.steps,
            "prompt_tokens": self.prompt_tokens,
            "stop_reason": result.stop_reason,
        }


class Decoder:
    def __init__(self, target: LoadedModel, make_drafter: Callable[[], Drafter | None], plan: Plan | None,
                 verify: str | None, draft: LoadedModel | None = None, lean_target: LeanModel | None = None,
                 lean_draft: LeanModel | None = None) -> None:
        self.target = target
        self.draft = draft
        self.lean_draft = lean_draft
        self.plan = plan
        self.make_drafter = make_drafter
        self.lean_target = lean_target or LeanModel(target.model)
        self.engine = SpeculativeEngine(self.lean_target, make_drafter(), target.stop_token_ids, verify)

    def restart(self) -> None:
        """A fresh drafter: forget what a trie learned (so a benchmark matches an offline replay)."""
        self.engine.drafter = self.make_drafter() or self.engine.drafter

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def default_params(self) -> SamplingParams:
        sampling = self.plan.sampling if self.plan else {}
        return SamplingParams(temperature=float(sampling.get("temperature", 0.0)),
                              top_p=float(sampling.get("top_p", 1.0)), top_k=int(sampling.get("top_k", 0)))

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt, chat)
        return list(prompt)

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, params: SamplingParams | None = None,
                 seed: int | None = None, chat: bool = False,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationOutput:
        if max_new_tokens < 1:
            raise UserError(f"the number of new tokens must be >= 1, got {max_new_tokens}")
        ids = self.encode(prompt, chat)
        result = self.engine.generate(ids, max_new_tokens, params or self.default_params(), seed, on_tokens)
        return GenerationOutput(result, self.tokenizer.decode(result.tokens, skip_special_tokens=True), len(ids))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def lean_model(loaded: LoadedModel, device: str, vocabulary: int | None = None) -> LeanModel:
    """The decoder's forward for a loaded model, scoring only the ids below `vocabulary` (and the stop tokens)
    if given; on a GPU every shape replays as a CUDA graph."""
    model = LeanModel(loaded.model, device)
    if vocabulary is not None:
        model.limit_vocabulary(vocabulary, loaded.stop_token_ids)
    if model.device.type == "cuda":
        enable_cuda_graphs(model)
    return model


def load_decoder(plan_path: str | Path | None = None, target: str | None = None, draft: str | None = None,
                 dtype: str | None = None, draft_dtype: str | None = None, verify: str | None = None,
                 log: Callable[[str], None] = lambda message: None, device: str | None = None) -> Decoder:
    """Load the plan (if any) and the models it names (or the ones given), and build its drafter."""
    device = device or default_device()
    plan = load_plan(plan_path) if plan_path is not None else None
    target_name = target or (plan.models.target if plan else None)
    if not target_name:
        raise UserError("no target model: name one, or give a plan that names one")
    dtype = dtype or (plan.models.dtype if plan else None) or "fp32"
    log(f"loading {target_name} ({dtype})")
    target_model = load_model(target_name, dtype, log=log)
    lean_target = lean_model(target_model, device)
    if plan is None:
        return Decoder(target_model, lambda: None, None, verify, lean_target=lean_target)
    if plan.method == "lookahead":
        fingerprint = target_model.vocabulary
        if fingerprint != plan.tokenizer:
            raise UserError(f"{plan_path}: the plan was made for another tokenizer "
                            f"({plan.tokenizer.get('vocab_size')} tokens) than {target_name}'s "
                            f"({fingerprint['vocab_size']} tokens)")
        settings = plan.settings.check()
        return Decoder(target_model, lambda: TrieDrafter(Trie(settings)), plan, verify, lean_target=lean_target)
    if plan.method == "triforce":
        return _triforce_decoder(plan, target_model, lean_target, draft, draft_dtype or dtype, verify, log, device)
    if plan.method == "sequoia":
        draft_name = draft or plan.models.draft
        if not draft_name:
            raise UserError(f"{plan_path}: the plan names no draft model; name one")
        draft_dtype = draft_dtype or plan.models.draft_dtype or dtype
        log(f"loading {draft_name} ({draft_dtype})")
        draft_model = load_model(draft_name, draft_dtype, log=log)
        check_same_vocabulary(target_model, draft_model)
        lean_draft = lean_model(draft_model, device, plan.models.draft_vocab)
        return Decoder(target_model, lambda: SequoiaDrafter(lean_draft, list(plan.tree.parents)), plan, verify,
                       draft_model, lean_target, lean_draft)
    raise UserError(f"{plan_path}: plans of kind {plan.kind} cannot be run yet")


def _triforce_decoder(plan: Plan, target: LoadedModel, lean_target: LeanModel, draft_name: str | None,
                      draft_dtype: str, verify: str | None, log: Callable[[str], None], device: str) -> Decoder:
    from decoder.triforce import HierarchicalDrafter, RetrievalSettings, StreamingDrafter, bottom_trie_settings

    settings = plan.settings
    retrieval = RetrievalSettings(settings.budget, settings.chunk, settings.stride,
                                  settings.rebuild_below).check()
    draft_model = lean_draft = None
    draft_name = draft_name or plan.models.draft
    # loaded even where the plan does not speculate: bench baselines use it
    if settings.bottom == "model" or (settings.bottom == "streaming" and plan.models.draft):
        if not draft_name:
            raise UserError("the plan's bottom level is a draft model but names none; name one")
        log(f"loading {draft_name} ({draft_dtype})")
        draft_model = load_model(draft_name, draft_dtype, log=log)
        check_same_vocabulary(target, draft_model)
        lean_draft = lean_model(draft_model, device)

    def bottom() -> Drafter:
        if settings.bottom == "trie":
            return TrieDrafter(Trie(bottom_trie_settings(settings.gamma1)))
        if settings.bottom == "model":
            return StreamingDrafter(lean_draft, settings.gamma1, settings.sinks, settings.window)
        return NoDrafter()

    def hierarchy() -> Drafter | None:
        if not settings.speculate:
            return None
        if settings.bottom == "streaming":  # no middle level: the StreamingLLM draft drafts for the top
            return StreamingDrafter(lean_draft or lean_target, settings.gamma2, settings.sinks,
                                    settings.window)
        return HierarchicalDrafter(lean_target, bottom(), settings.gamma1, settings.gamma2, retrieval)

    return Decoder(target, hierarchy, plan, verify, draft_model, lean_target, lean_draft)
