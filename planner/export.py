"""A Sequoia plan's tree in the form each serving engine takes as it is, and the inverse import of those forms.

Every export first holds the tree to the engine's rules (planner/engines.py) and refuses, in one line, a tree the
engine would not run as it is. What the engine needs beside the tree (the draft model's path, flags, the attention
backend) comes back as `Export.instructions`, for stderr.
"""

from __future__ import annotations

import io
import json
import shlex
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import yaml

from specplan.core.choices import EXPORT_FORMATS, VLLM_METHODS
from specplan.core.errors import UserError
from specplan.core.plan_schema import Plan, TokenTree
from specplan.core.profile_schema import is_llama_server_environment
from specplan.core.validate import Fields
from specplan.planner.draft_chain import HF_SCHEDULES
from specplan.planner.engines import (
    SGLANG_ADAPTIVE,
    TRTLLM_ARGS,
    TRTLLM_SPEC_UTILS,
    VLLM_DYNAMIC_SD,
    VLLM_SPECULATIVE_CONFIG,
    check_tree,
    engine_rules,
)
from specplan.planner.prompt_lookup import LLAMA_SERVER_NGRAM

NEEDS_DRAFT_PATH = ("vllm", "trtllm", "trtllm-draft", "sglang", "llama.cpp", "hf")
LOOKUP_FORMATS = {"llama-server": "llama.cpp"}  # an n-gram engine's export format, where not the engine's own name
GROWMAP_MAX_NODES = 4096  # the growmap holds a dense n x n mask: 16 M entries here


@dataclass(frozen=True)
class Export:
    content: str | bytes  # bytes: the Sequoia reference's torch.save file
    instructions: str  # how to run it: for stderr


def _choices(tree: TokenTree) -> list[list[int]]:
    """Rank paths level by level, siblings in rank order: the order Medusa, EAGLE and vLLM sort choices into."""
    return [list(path) for path in sorted(tree.paths(), key=lambda p: (len(p), p))]


def sequoia_growmap(tree: TokenTree) -> dict[str, Any]:
    """The reference implementation's growmap (tests/run_sequoia.py reads size, roots, branches; its engine the
    mask and depth as int64 tensors)."""
    import torch

    if tree.size > GROWMAP_MAX_NODES:
        raise UserError(f"a {tree.size}-node tree is too large for the sequoia growmap (a dense n x n mask); it "
                        f"takes at most {GROWMAP_MAX_NODES} nodes")
    depths = tree.depths
    levels = [[v for v in range(tree.size) if depths[v] == k] for k in range(tree.depth + 1)]
    mask = torch.zeros(tree.size, tree.size, dtype=torch.int64)
    for v in range(tree.size):
        if v:
            mask[v] = mask[tree.parents[v]]
        mask[v, v] = 1
    children = tree.children
    return {"roots": levels, "branches": [[len(children[v]) for v in level] for level in levels],
            "Successors": children, "mask": mask, "depth": torch.tensor(depths, dtype=torch.int64),
            "size": tree.size}


def _schedule_rows(plan: Plan, context: int) -> list[tuple[int, int, int]]:
    """A chain plan's schedule as (first batch size, last, draft tokens K; 0: off): the table of sequences of
    `context` tokens, where the plan has one per context range (the engines' tables have a batch axis only); ranges
    of equal K joined (off entries that differ only in the candidate our per-request decisions may draft)."""
    runs = [(drafted, list(entries)) for drafted, entries
            in groupby(plan.schedule.table_for(context).entries, key=lambda e: (e.decoding_length or 1) - 1)]
    return [(entries[0].low, entries[-1].high, drafted) for drafted, entries in runs]


def _context_note(plan: Plan, context: int) -> str:
    """Which of the plan's context tables an engine's batch-size table was taken from (nothing where it has one)."""
    if len(plan.schedule.tables) == 1:
        return ""
    table = plan.schedule.table_for(context)
    return (f"; the plan's table for sequences of {context} tokens (priced at {table.context}; --context picks "
            f"another of its {len(plan.schedule.tables)})")


def export_plan(plan: Plan, fmt: str, draft_path: str | None = None, heads: int | None = None,
                method: str = "draft_model", concurrency: int | None = None, context: int = 4096) -> Export:
    """`plan`'s tree as engine `fmt` takes it; refused in one line when the tree breaks the engine's rules or a
    path the engine needs is missing. A plan with a schedule per batch size exports it as the engine takes one
    (vLLM's num_speculative_tokens_per_batch_size, TensorRT-LLM's draft_len_schedule); llama-server has no table:
    its flags are the schedule's setting at `concurrency` requests, with that many slots of `context` tokens."""
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"unknown export format {fmt!r} (choose from {', '.join(EXPORT_FORMATS)})")
    if plan.method == "prompt-lookup":
        return _export_prompt_lookup(plan, fmt, concurrency, context)
    tree = plan.tree
    if tree is None:
        raise UserError(f"{plan.source}: a {plan.kind} has no token tree to export")
    if heads is None and plan.engine == fmt:  # the heads the plan was solved for
        recorded = plan.solver.get("engine")
        depth_cap = recorded.get("max_depth") if isinstance(recorded, dict) else None
        heads = depth_cap if isinstance(depth_cap, int) and not isinstance(depth_cap, bool) else None
    check_tree(tree, engine_rules(fmt, heads), plan.source)
    if fmt == "sglang" and plan.schedule is not None:
        if not draft_path:
            raise UserError("--format sglang needs --draft-path: the draft model as sglang loads it")
        return _sglang_schedule(plan, draft_path, method, concurrency, context)
    if fmt == "sglang" and plan.engine != "sglang":
        raise UserError(f"{plan.source}: SGLang grows its own tree from (num_steps, topk, num_draft_tokens); this "
                        "plan's tree is not one of those: solve with --engine sglang")
    if fmt in NEEDS_DRAFT_PATH and not draft_path:
        raise UserError(f"--format {fmt} needs --draft-path: the draft model as {fmt} loads it (a path or hub id)")
    depth = tree.depth
    choices = _choices(tree)
    target = _served_target(plan)
    if fmt == "sequoia":
        buffer = io.BytesIO()
        import torch

        torch.save(sequoia_growmap(tree), buffer)
        return Export(buffer.getvalue(), "the Sequoia reference: --growmap FILE (torch.load)")
    if fmt in ("medusa", "eagle1"):
        argument = "medusa_choices" if fmt == "medusa" else "tree_choices"
        return Export(json.dumps(choices), f"{fmt}: the model's {argument}")
    if fmt == "vllm":
        if method not in VLLM_METHODS:
            raise UserError(f"--method {method!r}: vLLM drafts a chain with {', '.join(VLLM_METHODS)}")
        config = {"method": method, "model": draft_path, "num_speculative_tokens": depth}
        written_for = f"vLLM's SpeculativeConfig at {VLLM_SPECULATIVE_CONFIG.commit[:12]}"
        if plan.schedule is not None:
            rows = _schedule_rows(plan, context)
            config["num_speculative_tokens"] = max(k for _, _, k in rows)
            if config["num_speculative_tokens"] == 0:
                return Export("{}", f"vllm serve {target} without --speculative-config: no draft length was "
                                    "predicted to pay at any batch size")
            config["num_speculative_tokens_per_batch_size"] = [list(row) for row in rows]
            written_for += f" and its dynamic schedule at {VLLM_DYNAMIC_SD.commit[:12]}{_context_note(plan, context)}"
        return Export(json.dumps(config), f"vllm serve {target} --speculative-config '<this JSON>' ({written_for})")
    if fmt == "trtllm":
        config = {"speculative_config": {"decoding_type": "Eagle", "max_draft_len": tree.size - 1,
                                         "speculative_model": draft_path, "eagle_choices": choices}}
        return Export(yaml.safe_dump(config, sort_keys=False),
                      "trtllm-serve ... --extra_llm_api_options <this YAML> (an EAGLE engine built with "
                      f"--max_draft_len >= {tree.size - 1} and --num_eagle_layers >= {depth})")
    if fmt == "trtllm-draft":
        speculative: dict[str, Any] = {"decoding_type": "Draft_Target", "max_draft_len": depth,
                                       "speculative_model": draft_path}
        header = f"# TensorRT-LLM's DraftTargetDecodingConfig ({TRTLLM_ARGS.path} at {TRTLLM_ARGS.commit[:12]})\n"
        note = ""
        if plan.schedule is not None:
            rows = _schedule_rows(plan, context)
            first = rows[0][2]
            if first == 0 or any(k > first for _, _, k in rows):
                raise UserError(f"{plan.source}: TensorRT-LLM takes a draft_len_schedule whose batch size 1 drafts "
                                f"the most (its max_draft_len); this schedule drafts {[k for _, _, k in rows]}: "
                                "export --format vllm, or drop --batches")
            speculative["max_draft_len"] = first
            speculative["draft_len_schedule"] = {high: k for _, high, k in rows}
            header += f"# draft_len_schedule as {TRTLLM_SPEC_UTILS.path} at {TRTLLM_SPEC_UTILS.commit[:12]} reads it\n"
            note = (f" (above {rows[-1][1]} requests, the largest batch size priced, it drafts nothing)"
                    if rows[-1][2] else "") + _context_note(plan, context)
        return Export(header + yaml.safe_dump({"speculative_config": speculative}, sort_keys=False),
                      "trtllm-serve ... --extra_llm_api_options <this YAML>" + note)
    if fmt == "sglang":
        triple = plan.solver.get("sglang") if isinstance(plan.solver.get("sglang"), dict) else {}
        if not all(isinstance(triple.get(k), int) for k in ("num_steps", "topk", "num_draft_tokens")):
            raise UserError(f"{plan.source}: the plan records no SGLang (num_steps, topk, num_draft_tokens): solve "
                            "with --engine sglang")
        flags = (f"--speculative-algorithm EAGLE --speculative-draft-model-path {draft_path} "
                 f"--speculative-num-steps {triple['num_steps']} --speculative-eagle-topk {triple['topk']} "
                 f"--speculative-num-draft-tokens {triple['num_draft_tokens']}")
        return Export(flags, f"python -m sglang.launch_server --model-path {target} <these flags> (a separate draft "
                             "model, not EAGLE heads: --speculative-algorithm STANDALONE)")
    chain = Fields(plan.solver, f"{plan.source}: solver").sub("chain_knobs", required=False) \
        if plan.engine == fmt else None
    best = chain.sub("best") if chain is not None else None
    if fmt == "llama.cpp" and plan.schedule is not None:  # its slots, drafting or not
        return _llama_server_at(plan, draft_path, best, concurrency, context)
    if chain is not None and not chain.boolean("enabled", default=True):
        return Export("{}" if fmt == "hf" else "",
                      f"{fmt} without a draft model: no setting of its knobs was predicted faster than its one-token "
                      f"decoding on the profile (the best, draft {best.integer('draft_max', low=1)} tokens: "
                      f"{best.number('tokens_per_step', low=1.0):.2f} tokens/step, "
                      f"{best.number('speedup', low=0.0):.2f}x)")
    if fmt == "llama.cpp":
        draft_min, p_min = (best.integer("draft_min", low=0), best.number("p_min", low=0.0, high=1.0)) \
            if best is not None else (0, 0.0)
        # llama-server's flags at build 11434: --draft-max/--draft-min are removed there, and a draft model alone
        # (--model-draft) is loaded but not drafted with unless --spec-type names draft-simple
        return Export(f"--spec-type draft-simple --spec-draft-model {draft_path} --spec-draft-n-max {depth} "
                      f"--spec-draft-n-min {draft_min} --spec-draft-p-min {p_min}",
                      f"{_llama_server_invocation(plan)} <these flags>" + (
                          "" if best is not None else " (draft-p-min 0: every step drafts the full chain the plan "
                                                      "priced)"))
    config = {"assistant_model": draft_path,
              "assistant_generation_config": {"num_assistant_tokens": depth,
                                              "num_assistant_tokens_schedule": best.string(
                                                  "schedule", choices=HF_SCHEDULES) if best is not None else "constant",
                                              "assistant_confidence_threshold": 0.0}}
    return Export(json.dumps(config), "assistant = AutoModelForCausalLM.from_pretrained(<assistant_model>); "
                                      "assistant.generation_config.update(**<assistant_generation_config>); "
                                      "model.generate(**inputs, assistant_model=assistant): transformers reads these "
                                      "knobs from the assistant's generation config, not from generate's kwargs")


def _served_target(plan: Plan) -> str:
    """The target as the engine's command line names it: the plan's, unless a config.json a modeled plan was solved on
    (the engine loads the real weights, which only the user can name)."""
    target = plan.models.target
    return "TARGET" if target is None or target.endswith(".json") else target


def _sglang_schedule(plan: Plan, draft_path: str, method: str, concurrency: int | None, context: int) -> Export:
    """A chain schedule for SGLang: with an EAGLE head (`--method eagle|eagle3`), its adaptive-steps config, one tier
    per range keyed at the range's first batch size with the range's draft length its one candidate (SGLang routes a
    batch to the largest key at or below it); a standalone draft runs no adaptive steps there, so its static flags
    at the `concurrency` stated."""
    target = _served_target(plan)
    rows = _schedule_rows(plan, context)
    if method in ("eagle", "eagle3"):
        config: dict[str, Any] = {"written_for": f"SGLang {SGLANG_ADAPTIVE.path} at {SGLANG_ADAPTIVE.commit[:12]}"}
        config.update({str(low): {"candidate_steps": [k]} for low, _, k in rows})
        largest = max(k for _, _, k in rows)
        flags = (f"--speculative-algorithm {method.upper()} --speculative-draft-model-path {draft_path} "
                 f"--speculative-eagle-topk 1 --speculative-num-steps {largest} --speculative-num-draft-tokens "
                 f"{largest + 1} --speculative-adaptive --speculative-adaptive-config <this JSON>")
        return Export(json.dumps(config, indent=1), f"python -m sglang.launch_server --model-path {target} {flags} "
                      "(under CUDA graphs SGLang routes the padded batch size: a batch may take the next range's "
                      f"tier){_context_note(plan, context)}")
    if concurrency is None:
        raise UserError("SGLang's adaptive steps run EAGLE heads only (--method eagle|eagle3 if the draft is one); "
                        "a standalone draft takes one draft length: give --concurrency, the requests you serve at "
                        "once, and the schedule's setting there is exported")
    entry = plan.schedule.entry_for(concurrency, context)
    if not entry.speculate:
        return Export("", f"python -m sglang.launch_server --model-path {target}: at {concurrency} requests no draft "
                          "length was predicted to pay, so no speculative flags")
    k = entry.decoding_length - 1
    return Export(f"--speculative-algorithm STANDALONE --speculative-draft-model-path {draft_path} "
                  f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}",
                  f"python -m sglang.launch_server --model-path {target} <these flags>: the schedule's draft length at "
                  f"{concurrency} requests (batch sizes {entry.low}-{entry.high})")


def _llama_server_at(plan: Plan, draft_path: str, best: Fields | None, concurrency: int | None,
                     context: int) -> Export:
    """llama-server's flags for `concurrency` requests in flight (it takes one draft length for all its slots): the
    schedule's draft length there, `-np` slots of `context` tokens each."""
    slots = _llama_server_slots(concurrency, context)
    entry = plan.schedule.entry_for(concurrency, context)
    if not entry.speculate:
        return Export(slots, f"{_llama_server_invocation(plan)} <these flags>: at {concurrency} requests no draft "
                             "length was predicted to pay, so no draft model")
    draft_min, p_min = (best.integer("draft_min", low=0), best.number("p_min", low=0.0, high=1.0)) \
        if best is not None else (0, 0.0)
    k = entry.decoding_length - 1
    return Export(f"{slots} --spec-type draft-simple --spec-draft-model {draft_path} --spec-draft-n-max {k} "
                  f"--spec-draft-n-min {min(draft_min, k)} --spec-draft-p-min {p_min}",
                  f"{_llama_server_invocation(plan)} <these flags>: the schedule's draft length at {concurrency} "
                  f"requests (batch sizes {entry.low}-{entry.high})")


def _llama_server_invocation(plan: Plan) -> str:
    """How to start llama-server as the plan's profile timed it: after the options its environment set there
    (`LLAMA_ARG_REPACK=false` where its AMX kernels crash)."""
    profile = plan.inputs.get("profile")
    environment = (profile.get("environment") if isinstance(profile, dict) else None) or {}
    if not is_llama_server_environment(environment):
        raise UserError(f"{plan.source}: inputs: profile: environment must map LLAMA_ARG_ names to strings")
    return " ".join([f"{name}={shlex.quote(value)}" for name, value in environment.items()]
                    + ["llama-server -m TARGET.gguf"])


def _llama_server_slots(concurrency: int | None, context: int) -> str:
    """llama-server's `concurrency` slots of `context` tokens each: it takes one speculative setting for all of them,
    so its flags are exported for the requests the user serves at once."""
    if concurrency is None:
        raise UserError("llama-server takes one speculative setting for all its slots: give --concurrency, the "
                        "requests you serve at once, and the plan's setting there is exported")
    return f"-np {concurrency} -c {concurrency * context}"


def _llama_server_ngram(plan: Plan, concurrency: int | None, context: int) -> Export:
    """llama-server's ngram-simple flags for `concurrency` requests in flight: the schedule's draft length there (the
    plan's own without a schedule), its n-gram the plan's, `-np` slots of `context` tokens each."""
    slots = _llama_server_slots(concurrency, context)
    settings = plan.settings
    drafted = settings.num_tokens if settings.enabled else None
    if plan.schedule is not None:
        entry = plan.schedule.entry_for(concurrency, context)
        drafted = entry.decoding_length - 1 if entry.speculate else None
    if drafted is None:
        return Export(slots, f"{_llama_server_invocation(plan)} <these flags>: at {concurrency} requests no n-gram "
                             "drafting was predicted to pay, so no --spec-type")
    return Export(f"{slots} --spec-type ngram-simple --spec-ngram-simple-size-n {settings.max_ngram} "
                  f"--spec-ngram-simple-size-m {drafted}",
                  f"{_llama_server_invocation(plan)} <these flags> (llama.cpp build {LLAMA_SERVER_NGRAM.commit}'s "
                  f"ngram-simple, as replayed)")


def import_tree(data: str | bytes, fmt: str) -> TokenTree:
    """Inverse of export_plan: the tree an export holds (for a chain format, the chain of its draft length)."""
    try:
        if fmt == "sequoia":
            import torch

            growmap = torch.load(io.BytesIO(data if isinstance(data, bytes) else data.encode()), weights_only=True)
            parents = [-1] * int(growmap["size"])
            for v, kids in enumerate(growmap["Successors"]):
                for child in kids:
                    parents[child] = v
            return TokenTree.from_parents(parents, "growmap")
        text = data.decode() if isinstance(data, bytes) else data
        if fmt in ("medusa", "eagle1"):
            choices = json.loads(text)
        elif fmt == "trtllm":
            choices = yaml.safe_load(text)["speculative_config"]["eagle_choices"]
        elif fmt in ("vllm", "trtllm-draft", "llama.cpp", "hf"):
            return TokenTree.from_parents(list(range(-1, _chain_length(text, fmt))), fmt)
        elif fmt == "sglang":
            raise UserError("SGLang's flags hold no tree: it grows one from (num_steps, topk, num_draft_tokens)")
        else:
            raise UserError(f"unknown format {fmt!r} (choose from {', '.join(EXPORT_FORMATS)})")
    except (json.JSONDecodeError, yaml.YAMLError, KeyError, TypeError, ValueError, SyntaxError, IndexError,
            RuntimeError, EOFError) as exc:
        raise UserError(f"cannot read a {fmt} tree: {exc.__class__.__name__}") from None
    if not isinstance(choices, (list, tuple)):
        raise UserError(f"a {fmt} tree must be a list of paths")
    return TokenTree.from_paths(list(choices), fmt)


def _chain_length(text: str, fmt: str) -> int:
    if fmt == "vllm":
        return int(json.loads(text)["num_speculative_tokens"])
    if fmt == "trtllm-draft":
        return int(yaml.safe_load(text)["speculative_config"]["max_draft_len"])
    if fmt == "hf":  # {} (no assistant) where the plan drafts nothing
        config = json.loads(text)
        return int(config["assistant_generation_config"]["num_assistant_tokens"]) if config else 0
    flags = text.split()  # no flags (no draft model) where the plan drafts nothing
    return int(flags[flags.index("--spec-draft-n-max") + 1]) if flags else 0


def _export_prompt_lookup(plan: Plan, fmt: str, concurrency: int | None, context: int) -> Export:
    """An engine's n-gram knobs, for that engine alone (its matching rule is what the plan replayed)."""
    own_format = LOOKUP_FORMATS.get(plan.engine, plan.engine)
    if fmt != own_format:
        raise UserError(f"{plan.source}: this plan replays {plan.engine}'s n-gram drafting; export it as --format "
                        f"{own_format}, or solve with --engine {fmt}")
    if plan.engine == "llama-server":
        return _llama_server_ngram(plan, concurrency, context)
    if plan.schedule is not None:
        raise UserError(f"{plan.source}: {plan.engine}'s n-gram drafting takes no table per batch size here")
    settings = plan.settings
    if not settings.enabled:
        sglang = fmt == "sglang"
        return Export("" if sglang else "{}", f"{fmt} without {'NGRAM' if sglang else 'prompt lookup'}: no setting "
                                              "beat its one-token decoding on the profile")
    if fmt == "sglang":
        return Export(f"--speculative-algorithm NGRAM --speculative-num-draft-tokens {settings.num_draft_tokens} "
                      f"--speculative-ngram-max-trie-depth {settings.max_trie_depth} "
                      f"--speculative-ngram-min-bfs-breadth {settings.min_bfs_breadth} "
                      f"--speculative-ngram-max-bfs-breadth {settings.max_bfs_breadth} "
                      f"--speculative-ngram-match-type {settings.match_type}",
                      "python -m sglang.launch_server --model-path TARGET <these flags> (SGLang 0.5.23's flag names; "
                      "the plan replayed one server serving the recorded prompts in order from its start)")
    if fmt == "vllm":
        return Export(json.dumps({"method": "ngram", "num_speculative_tokens": settings.num_tokens,
                                  "prompt_lookup_max": settings.max_ngram, "prompt_lookup_min": settings.min_ngram}),
                      "vllm serve TARGET --speculative-config '<this JSON>'")
    if fmt == "hf":
        return Export(json.dumps({"prompt_lookup_num_tokens": settings.num_tokens,
                                  "max_matching_ngram_size": settings.max_ngram}),
                      "model.generate(**inputs, **<these kwargs>)")
    return Export(json.dumps({"max_ngram_size": settings.max_ngram, "num_pred_tokens": settings.num_tokens}),
                  "llama_cpp.Llama(..., draft_model=LlamaPromptLookupDecoding(**<these kwargs>), logits_all=True)")
