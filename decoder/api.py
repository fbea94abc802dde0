"""The Python API: load a plan with its models, then generate.

    from specplan.decoder.api import load_decoder
    decoder = load_decoder("plans/qwen2.5-coder-1.5b.sequoia.cpu-2c.fp32.yaml")
    output = decoder.generate("Write a quicksort in Python.", max_new_tokens=128, chat=True)
    print(output.text, output.result.tokens_per_second)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specplan.core.choices import BACKENDS, DEFAULT_PROMPT_CACHE_MIB, TIMED_FORWARDS
from specplan.core.errors import UserError
from specplan.core.machine import machine_difference, this_machine
from specplan.core.method_settings import TrieSettings
from specplan.core.models import LoadedModel, check_same_vocabulary, load_model
from specplan.core.plan_schema import Plan, load_plan
from specplan.core.profile_schema import load_profile
from specplan.core.prompts import encode_prompt
from specplan.decoder.batching import Completion, Request, Scheduler
from specplan.decoder.cuda_graphs import compile_forward, enable_cuda_graphs
from specplan.decoder.draft_rules import RULE_CHAIN_TOKENS, TRTLLM_AUTO_TIERS, rule_maker
from specplan.decoder.drafters import Drafter, NoDrafter, SequoiaDrafter, TrieDrafter
from specplan.decoder.engine import GenerationResult, SpeculativeEngine
from specplan.decoder.gate import StepClock
from specplan.decoder.model import SUPPORTED_ARCHITECTURES, LeanModel, ModelShape, cache_slots
from specplan.decoder.offload import DEVICE_RESERVE_BYTES, STREAM_BUFFERS
from specplan.decoder.sampling import SamplingParams
from specplan.decoder.sharing import SharedRows
from specplan.decoder.transformers_forward import TransformersForward
from specplan.decoder.trie import Trie


@dataclass
class GenerationOutput:
    result: GenerationResult
    text: str
    prompt_tokens: int
    backend: str

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
            "backend": self.backend,
        }


class Decoder:
    def __init__(self, target: LoadedModel, make_drafter: Callable[[], Drafter | None], plan: Plan | None,
                 verify: str | None, target_forward: Forward, draft: LoadedModel | None = None,
                 draft_forward: Forward | None = None) -> None:
        self.target = target
        self.draft = draft
        self.draft_forward = draft_forward
        self.plan = plan
        self.make_drafter = make_drafter
        self.target_forward = target_forward
        # each request drafts at a step only while its own drafts pay at the plan's price, once measured at the
        # steps' own (decoder/gate.py); or, a plan solved to share a step's rows, by the rows it is given
        # (decoder/sharing.py)
        self.engine = SpeculativeEngine(self.target_forward, make_drafter(), target.stop_token_ids, verify,
                                        plan.predicted_at if plan is not None else None,
                                        plan.schedule if plan is not None else None, StepClock(),
                                        SharedRows(plan.sharing) if plan is not None and plan.sharing else None)
        self.slot_drafters: dict[int, Drafter] = {}  # a batch's slots beyond the first (slot 0: the engine's)

    def draft_every_step(self) -> None:
        """Draft at every step of every request, as the plan's schedule says, whatever the request's drafts yield."""
        self.engine.pricing = self.engine.sharing = None

    def unshared(self) -> None:
        """The plan as it would run without its `sharing`: its own trie, each request's drafting decided by the
        schedule and its own drafts (decoder/gate.py); the static schedule shared rows are measured against
        (`plan serve --no-sharing`)."""
        plan = self.plan
        settings = plan.settings.check()
        self.engine.sharing = None
        self.make_drafter = lambda: _for_one_sequence(plan, TrieDrafter(Trie(settings)))
        self.engine.drafter = self.make_drafter()
        self.slot_drafters.clear()

    def use_rule(self, name: str) -> None:
        """Decide every step's draft length by an engine's own rule (decoder/draft_rules.py: RULES) instead of the
        plan's schedule and the per-request decisions, on the drafter that engine made the rule for: n-gram
        drafting (a Lookahead plan's trie, as long as the rule drafts) or a draft model's chain (a Sequoia chain
        plan's draft, as long as RULE_CHAIN_TOKENS)."""
        make_rule = rule_maker(name)
        plan = self.plan
        on_chain = make_rule().on_chain
        if on_chain and (plan is None or plan.method != "sequoia" or not plan.tree.is_chain):
            raise UserError(f"the {name} rule drafts with a draft model's chain: give a Sequoia chain plan")
        if not on_chain and (plan is None or plan.method != "lookahead"):
            raise UserError(f"the {name} rule drafts n-grams: give a Lookahead plan (its trie drafts them)")
        if on_chain:
            draft = self.draft_forward
            make_drafter = lambda: SequoiaDrafter(draft, list(range(-1, RULE_CHAIN_TOKENS)))  # noqa: E731
        else:
            settings = TrieSettings.sized(max(plan.settings.decoding_length, TRTLLM_AUTO_TIERS[0][1] + 1),
                                          plan.settings.branch_length)
            make_drafter = lambda: TrieDrafter(Trie(settings))  # noqa: E731

        def with_rule() -> Drafter:
            drafter = make_drafter()
            drafter.rule = make_rule()
            return drafter

        self._draft_with(with_rule)

    def fix_setting(self, length: int) -> None:
        """Draft `length` nodes per sequence (root included) at every step, whatever the batch size, context or the
        request's drafts: one of the settings the plan's schedule chooses among, run alone (`plan serve --setting`,
        the fixed settings `plan bench --settings` measures a schedule against). A Lookahead trie's retrieval or a
        draft chain is cut there, as a schedule cuts it."""
        if self.plan is None or self.plan.method not in ("lookahead", "sequoia", "triforce"):
            raise UserError("--setting runs a Lookahead plan, a Sequoia chain or a TriForce hierarchy at one drafting "
                            "length")
        # a plan's shared rows run on their own trie, whose length bounds the settings; else the plan's
        largest = (None if self.plan.sharing else self.plan.largest_setting) or self.engine.drafter.max_tree_size
        if largest < 2:
            raise UserError("--setting: this plan drafts at no batch size (its tree is the root alone)")
        if not 2 <= length <= largest:
            raise UserError(f"--setting {length}: this plan drafts 2 to {largest} nodes per sequence (root included)")
        make_drafter = self.make_drafter

        def fixed() -> Drafter:
            drafter = make_drafter()
            drafter.draft_nodes(length)
            return drafter

        self._draft_with(fixed)

    def _draft_with(self, make_drafter: Callable[[], Drafter]) -> None:
        """Every request's drafter from `make_drafter` from now on, which decides its own lengths: no schedule, no
        per-request decisions."""
        self.engine.schedule = self.engine.pricing = self.engine.sharing = None
        self.make_drafter = make_drafter
        self.engine.drafter = make_drafter()
        self.slot_drafters.clear()

    def restart(self) -> None:
        """Fresh drafters: forget what a trie learned (so a benchmark matches an offline replay)."""
        self.engine.drafter = self.make_drafter() or self.engine.drafter
        self.slot_drafters.clear()

    def drafter_for_slot(self, slot: int) -> Drafter:
        """The drafter of a batch's slot, kept across the requests the slot serves (a trie keeps learning)."""
        if slot == 0:
            return self.engine.drafter
        drafter = self.slot_drafters.get(slot)
        if drafter is None:
            drafter = self.slot_drafters[slot] = self.make_drafter() or NoDrafter()
            drafter.use_slot(slot)
        return drafter

    def scheduler(self, concurrency: int, prefill_chunk: int = 0, prompt_cache_mib: int = DEFAULT_PROMPT_CACHE_MIB
                  ) -> Scheduler:
        """A continuous-batching scheduler over this decoder's target and drafters (decoder/batching.py), its
        slots' lost prefixes kept in up to `prompt_cache_mib` of host memory (decoder/prompt_cache.py)."""
        return Scheduler(self.engine, self.drafter_for_slot, concurrency, prefill_chunk, prompt_cache_mib)

    def check_memory(self, concurrency: int, max_len: int) -> None:
        """Refuse, before any work, a concurrency whose caches of `max_len` slots do not fit the free memory."""
        needed = concurrency * sum(cache_bytes(forward, max_len) for forward in
                                   (self.target_forward, self.draft_forward) if forward is not None)
        free = free_memory(self.target_forward.device)
        if free is not None and needed > free:
            raise UserError(f"{concurrency} sequences of up to {max_len} tokens need {needed / 2**30:.1f} GiB of KV "
                            f"cache; {free / 2**30:.1f} GiB is free")

    def generate_many(self, requests: list[Request], concurrency: int, prefill_chunk: int = 0
                      ) -> Iterator[Completion]:
        """Decode `requests` (token ids; see `encode`) with up to `concurrency` in flight; completions in the order
        they finish, each with the id of its place in `requests`."""
        longest = max((len(r.prompt) + r.max_new_tokens for r in requests), default=0)
        self.check_memory(min(concurrency, len(requests)), longest + self.engine.drafter.max_tree_size)
        return self.scheduler(concurrency, prefill_chunk).run(requests)

    def output(self, result: GenerationResult, prompt_tokens: int) -> GenerationOutput:
        return GenerationOutput(result, self.tokenizer.decode(result.tokens, skip_special_tokens=True), prompt_tokens,
                                self.target_forward.backend)

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
        return self.output(result, len(ids))


def cache_bytes(forward: Forward, max_len: int) -> int:
    """The bytes of one sequence's KV cache for `max_len` slots on `forward`'s model (its whole blocks: cache_slots)."""
    shape = forward.shape
    slots = cache_slots(max_len, shape.max_context)
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * slots * torch.finfo(forward.dtype).bits // 8


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new caches: the GPU's free memory, or the host's available memory (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


Forward = LeanModel | TransformersForward  # what the engine, the drafters and the profiler run


def choose_backend(config: Any, backend: str = "auto") -> str:
    """The backend that runs a model: `auto` takes the lean forward for the architectures it runs and
    transformers' own forward for any other."""
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend == "auto":
        return "lean" if config.model_type in SUPPORTED_ARCHITECTURES else "transformers"
    return backend


def load_forward(loaded: LoadedModel, device: str, vocabulary: int | None = None, backend: str = "auto",
                 offload: str | None = None, resident_layers: int | None = None) -> Forward:
    """The decoder's forward for a loaded model, scoring only the ids below `vocabulary` (and the stop tokens)
    if given; on a GPU the lean forward replays every shape as a CUDA graph. `offload` (decoder/offload.py): "weights"
    keeps only the first `resident_layers` layers on the device (default: as many as a GPU's free memory holds; on a
    CPU none) and streams the others; "kv" keeps the "target" role's caches in host memory."""
    always = loaded.stop_token_ids
    if offload is not None and (loaded.dtype == "gguf" or choose_backend(loaded.config, backend) != "lean"):
        raise UserError("offloaded weights stream into the lean forward on PyTorch's operators: dtype fp32 or bf16, "
                        "backend lean")
    if choose_backend(loaded.config, backend) == "transformers":
        if loaded.dtype == "gguf":
            raise UserError("dtype gguf runs on the lean decoder's CPU kernels, not on the transformers backend")
        return TransformersForward(loaded.transformers_model(), device, vocabulary, always)
    if loaded.dtype == "gguf" and torch.device(device).type != "cpu":
        raise UserError("dtype gguf runs on the CPU kernels; on a GPU choose fp32 or bf16")
    compiled = choose_backend(loaded.config, backend) == "compiled"
    if compiled and torch.device(device).type != "cuda":
        raise UserError("the compiled backend runs torch.compile under CUDA graphs and needs a GPU; on a CPU the "
                        "lean backend runs the project's own kernels")
    blocks = loaded.block_weights() if loaded.dtype == "gguf" else None
    hf_model = loaded.transformers_model()
    if offload == "weights" and resident_layers is None:
        resident_layers = fitting_layers(hf_model, torch.device(device)) if torch.device(device).type == "cuda" else 0
    model = LeanModel(hf_model, device, release=True, vocabulary=vocabulary, always=always,
                      block_weights=blocks, resident_layers=resident_layers if offload == "weights" else None,
                      offload_kv=offload == "kv")
    loaded.released = True
    if compiled:
        compile_forward(model)
    if model.device.type == "cuda" and offload is None:
        enable_cuda_graphs(model)
    return model


KV_ROOM_TOKENS = 4096  # the KV cache a GPU filled with layers at load still has room for (set --resident-layers)


def fitting_layers(hf_model: Any, device: torch.device) -> int:
    """How many of the model's first layers a GPU's free memory holds beside everything else that stays there: the
    other weights, STREAM_BUFFERS streamed layers, a KV cache of KV_ROOM_TOKENS tokens and DEVICE_RESERVE_BYTES."""
    shape = ModelShape.from_config(hf_model.config)
    layer_bytes = [0] * shape.layers
    other = 0
    for name, weight in hf_model.named_parameters():
        size = weight.numel() * weight.element_size()
        if name.startswith("model.layers."):
            layer_bytes[int(name.split(".")[2])] += size
        else:
            other += size
    element = next(hf_model.parameters()).element_size()
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * element * KV_ROOM_TOKENS
    free = free_memory(device) - DEVICE_RESERVE_BYTES - other - kv - STREAM_BUFFERS * max(layer_bytes)
    return max(0, min(shape.layers, int(free // max(layer_bytes))))


def load_decoder(plan_path: str | Path | None = None, target: str | None = None, draft: str | None = None,
                 dtype: str | None = None, draft_dtype: str | None = None, verify: str | None = None,
                 log: Callable[[str], None] = lambda message: None, device: str | None = None,
                 backend: str | None = None, offload: str | None = None, resident_layers: int | None = None
                 ) -> Decoder:
    """Load the plan (if any) and the models it names (or the ones given), and build its drafter. `backend`:
    the forward to run (decoder/api.py: choose_backend); by default the plan's, else `auto`. `offload`,
    `resident_layers`: the target's weights or KV cache in host memory (load_forward; the drafts stay whole)."""
    device = device or default_device()
    plan = load_plan(plan_path) if plan_path is not None else None
    if plan is not None and plan.method == "prompt-lookup":
        raise UserError(f"{plan_path}: a prompt-lookup plan runs in {plan.engine} (plan export, or plan bench with "
                        "its baselines), not in our decoder")
    target_name = target or (plan.models.target if plan else None)
    if not target_name:
        raise UserError("no target model: name one, or give a plan that names one")
    dtype = dtype or (plan.models.dtype if plan else None) or "fp32"
    log(f"loading {target_name} ({dtype})")
    target_model = load_model(target_name, dtype, log=log)
    # a plan priced on llama.cpp's own forward (an engine plan) runs here on ours
    planned = plan.models.backend if plan is not None and plan.models.backend in BACKENDS else None
    requested = backend or planned or "auto"
    backend = choose_backend(target_model.config, requested)
    if plan is not None and plan.models.backend not in (None, backend):
        log(f"note: the plan's prediction is for the {plan.models.backend} backend; running the {backend} one")
    log(f"backend: {backend}")
    elsewhere = profiled_elsewhere(plan, device) if plan is not None else None
    if elsewhere:  # the decisions re-price steps on this machine's clock; the plan's own choices stay that one's
        log(f"note: {plan_path} was solved on another machine's profile ({elsewhere}): its settings and predictions "
            "are that machine's; profile and solve here for this one's")
    target_forward = load_forward(target_model, device, backend=backend, offload=offload,
                                  resident_layers=resident_layers)
    if plan is None:
        return Decoder(target_model, lambda: None, None, verify, target_forward)
    if plan.method == "lookahead":
        fingerprint = target_model.vocabulary
        if fingerprint != plan.tokenizer:
            raise UserError(f"{plan_path}: the plan was made for another tokenizer "
                            f"({plan.tokenizer.get('vocab_size')} tokens) than {target_name}'s "
                            f"({fingerprint['vocab_size']} tokens)")
        settings = (plan.sharing.trie if plan.sharing is not None else plan.settings).check()

        return Decoder(target_model, lambda: _for_one_sequence(plan, TrieDrafter(Trie(settings))), plan, verify,
                       target_forward)
    if plan.method == "triforce":
        return _triforce_decoder(plan, target_model, target_forward, draft, draft_dtype or dtype, verify, log, device)
    if plan.method == "sequoia":
        draft_name = draft or plan.models.draft
        if not draft_name:
            raise UserError(f"{plan_path}: the plan names no draft model; name one")
        draft_dtype = draft_dtype or plan.models.draft_dtype or dtype
        log(f"loading {draft_name} ({draft_dtype})")
        draft_model = load_model(draft_name, draft_dtype, log=log)
        check_same_vocabulary(target_model, draft_model)
        draft_forward = load_forward(draft_model, device, plan.models.draft_vocab, requested)
        if plan.tree.size == 1:  # a plan that drafts at no batch size: no draft prefill per request (a rule may)
            decoder = Decoder(target_model, lambda: None, plan, verify, target_forward, draft_model, draft_forward)
            decoder.engine.schedule = None  # every entry is off: the root alone is all its tree holds
            return decoder
        return Decoder(target_model,
                       lambda: _for_one_sequence(plan, SequoiaDrafter(draft_forward, list(plan.tree.parents))), plan,
                       verify, target_forward, draft_model, draft_forward)
    raise UserError(f"{plan_path}: plans of kind {plan.kind} cannot be run yet")


def profiled_elsewhere(plan: Plan, device: str) -> str | None:
    """How the machine of the plan's profile differs from this one, if it does."""
    profile = plan.inputs.get("profile")
    if not isinstance(profile, dict):
        return None
    machine = profile.get("machine")
    if machine is None and Path(str(profile.get("file"))).is_file():  # solved before plans recorded the machine
        try:
            machine = load_profile(profile["file"], TIMED_FORWARDS).machine
        except UserError:
            return None
    return machine_difference(machine, this_machine(device)) if machine else None


def _for_one_sequence(plan: Plan, drafter: Drafter) -> Drafter:
    """`drafter` at the plan schedule's setting for one sequence (a batch's scheduler re-sets it every step)."""
    if plan.schedule is not None:
        drafter.follow(plan.schedule.entry_for(1))
    return drafter


def _triforce_decoder(plan: Plan, target: LoadedModel, target_forward: Forward, draft_name: str | None,
                      draft_dtype: str, verify: str | None, log: Callable[[str], None], device: str) -> Decoder:
    from specplan.decoder.triforce import HierarchicalDrafter, StreamingDrafter, bottom_trie_settings

    if not isinstance(target_forward, LeanModel):
        raise UserError("TriForce's retrieval cache needs the lean decoder; this target runs on the "
                        f"{target_forward.backend} backend")
    settings = plan.settings
    retrieval = settings.retrieval()
    draft_model = draft_forward = None
    draft_name = draft_name or plan.models.draft
    # loaded even where the plan does not speculate: bench baselines use it
    if settings.bottom == "model" or (settings.bottom == "streaming" and plan.models.draft):
        if not draft_name:
            raise UserError("the plan's bottom level is a draft model but names none; name one")
        log(f"loading {draft_name} ({draft_dtype})")
        draft_model = load_model(draft_name, draft_dtype, log=log)
        check_same_vocabulary(target, draft_model)
        draft_forward = load_forward(draft_model, device)

    def bottom() -> Drafter:
        if settings.bottom == "trie":
            return TrieDrafter(Trie(bottom_trie_settings(settings.gamma1)))
        if settings.bottom == "model":
            return StreamingDrafter(draft_forward, settings.gamma1, settings.sinks, settings.window)
        return NoDrafter()

    def hierarchy() -> Drafter | None:
        if not settings.speculate:
            return None
        if settings.bottom == "streaming":  # no middle level: the StreamingLLM draft drafts for the top
            return StreamingDrafter(draft_forward or target_forward, settings.gamma2, settings.sinks,
                                    settings.window)
        return _for_one_sequence(plan, HierarchicalDrafter(target_forward, bottom(), settings.gamma1, settings.gamma2,
                                                           retrieval))

    return Decoder(target, hierarchy, plan, verify, target_forward, draft_model, draft_forward)
