"""`plan bench`: our decoder and the baselines on the same prompts, same dtype, in one process.

Methods: `ours` (the plan, or without one our one-token decoding), `ours-ar` (our engine with a one-node tree),
the transformers baselines `hf` (generate), `hf-assisted` (assistant_model = the plan's draft),
`hf-prompt-lookup` (prompt_lookup_num_tokens = 10), and llama.cpp on the same GGUF (`llama.cpp` one token per
forward, `llama.cpp-lookup` its prompt lookup with as many tokens; specplan/llamacpp.py). For each prompt the
methods run back to back, so machine noise spreads evenly, and their order rotates from one prompt to the next,
so that no method always runs first or always right after transformers; one warm-up generation per method comes
first. Two rates per method: end-to-end tokens/s (new tokens over the wall time of the whole call, prefill
included) and decode tokens/s (tokens after the prefill over the time after it: for transformers and llama.cpp,
timed from the first emitted tokens on; for our engine, whose prefill stops before the last prompt token, every
new token over the decode time). Speedups compare decode rates, since at long contexts the prefill, the same work
for every method, would hide them; the end-to-end ratio against `hf` is reported too. A drafter's own prefill (a
draft model's prompt, a StreamingLLM window) counts as our engine's decoding time, since one-token decoding does
not pay it. Greedy runs are checked token by token against `hf`; at the first differing token the report gives
the target's top-2 logit gap (a near-tie below 1e-4 is rounding, not a bug: multi-token and one-token forwards
round differently).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specplan.core import progress
from specplan.core.choices import BASELINES, TIMED_FORWARDS
from specplan.core.errors import UserError
from specplan.core.fileio import atomic_output, read_json, write_json
from specplan.core.machine import cpu_info, machine_label, this_machine
from specplan.core.method_settings import PromptLookupSettings
from specplan.core.plan_schema import Plan
from specplan.core.plotting import pyplot, save_png
from specplan.core.profile_schema import LatencyProfile, load_profile
from specplan.core.prompts import encode_prompt
from specplan.core.provenance import check_unchanged
from specplan.core.validate import FORMAT_VERSION, Fields
from specplan.decoder.api import Decoder, profiled_elsewhere
from specplan.decoder.engine import SpeculativeEngine
from specplan.decoder.sampling import SamplingParams
from specplan.llamacpp import DraftChainSettings, LlamaCpp
from specplan.profiler.datasets import Prompt, read_dataset, spread_sample
from specplan.profiler.haystack import build_prompts

TRIFORCE_BASELINES = ("two-level", "streaming")
NEAR_TIE = 1e-4
# a prompt-lookup plan's engine: (its one-token baseline, its prompt-lookup baseline)
LOOKUP_BASELINES = {"hf": ("hf", "hf-prompt-lookup"), "llama.cpp": ("llama.cpp", "llama.cpp-lookup")}
REPRICE_PASSES = 2  # timed passes over the plan's priced points between two prompts


@dataclass
class BenchRequest:
    dataset: str
    prompts: int
    max_new_tokens: int
    baselines: list[str]
    params: SamplingParams
    seed: int = 0
    chat: bool = True
    prompt_lookup: PromptLookupSettings = PromptLookupSettings()  # the engines' own defaults: 2-grams, 10 tokens
    lookup_plan: Plan | None = None  # a prompt-lookup plan: its engine's lookup runs with the plan's knobs
    context: int | None = None  # build long prompts of this many tokens from the dataset's texts
    one_document: bool = False  # ... all about one document (profiler/haystack.py: build_prompts)
    reprice: bool = False  # re-time the forwards the plan's prediction priced, between the prompts


def run_bench(decoder: Decoder, request: BenchRequest, output: Path, log: Callable[[str], None] = progress.say) -> dict:
    unknown = set(request.baselines) - set(BASELINES)
    if unknown:
        raise UserError(f"unknown baseline {', '.join(sorted(unknown))} (choose from {', '.join(BASELINES)})")
    if "hf-assisted" in request.baselines and decoder.draft is None:
        raise UserError("hf-assisted needs a plan with a draft model")
    if any(b in TRIFORCE_BASELINES for b in request.baselines) and (decoder.plan is None
                                                                     or decoder.plan.method != "triforce"):
        raise UserError(f"the {', '.join(TRIFORCE_BASELINES)} baselines need a TriForce plan")
    if "llama.cpp-draft" in request.baselines and _llama_draft_chain(decoder) is None:
        raise UserError("llama.cpp-draft runs a plan solved with --engine llama.cpp from an acceptance file with "
                        "chain traces (plan accept sequoia at temperature 0)")
    if request.prompts < 1 or request.max_new_tokens < 1:
        raise UserError("--prompts and --max-new-tokens must be >= 1")
    tokenizer = decoder.tokenizer
    if request.context is not None:
        long_prompts = build_prompts(request.dataset, tokenizer, request.context, request.prompts, request.chat,
                                     one_document=request.one_document)
        prompts = [Prompt(p.id, p.category, "") for p in long_prompts]
        encoded = [p.ids for p in long_prompts]
    else:
        prompts = spread_sample(read_dataset(request.dataset), request.prompts)
        if not prompts:
            raise UserError(f"{request.dataset}: no prompts")
        encoded = [encode_prompt(tokenizer, p.text, request.chat) for p in prompts]
    for ids in encoded:
        decoder.engine.check_fits(len(ids), request.max_new_tokens)
    methods, engines = _methods(decoder, request, max(len(ids) for ids in encoded) + request.max_new_tokens)
    names = list(methods)
    repricing = _repricing(decoder) if request.reprice else None
    log(f"warming up {', '.join(names)}")
    warm_up = encoded[0] if request.context is not None else encoded[0][:64]  # long-context methods need it all
    for run in methods.values():
        run(warm_up, 8, 0)
    decoder.restart()
    if decoder.target_forward.graphed is not None:  # every prompt's caches and CUDA graphs made before the clocks run
        start = time.perf_counter()
        for engine in engines:
            for ids in encoded:
                engine.prepare(len(ids), request.max_new_tokens)
        log(f"caches and CUDA graphs for every prompt made in {time.perf_counter() - start:.1f} s")
    if repricing is not None:
        log(f"re-timing the plan's {len(repricing.timer.calls)} priced forwards and builds before each prompt "
            "and after the last")
        repricing.timer.run(REPRICE_PASSES, warmup=1)
    rows = []
    for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
        order = names[index % len(names):] + names[:index % len(names)]
        row: dict[str, Any] = {"id": prompt.id, "category": prompt.category, "prompt_tokens": len(ids),
                               "order": order, "methods": {}}
        for name in order:
            start = time.perf_counter()
            tokens, extra = methods[name](ids, request.max_new_tokens, request.seed + index)
            seconds = time.perf_counter() - start
            decode_tokens, decode_seconds = extra.pop("decode")
            row["methods"][name] = {"new_tokens": len(tokens), "seconds": seconds,
                                    "tokens_per_second": len(tokens) / seconds, "decode_tokens": decode_tokens,
                                    "decode_seconds": decode_seconds,
                                    "decode_tokens_per_second": _rate(decode_tokens, decode_seconds),
                                    "tokens": tokens, **extra}
        if request.params.greedy and "hf" in row["methods"]:
            reference = row["methods"]["hf"]["tokens"]
            for name, entry in row["methods"].items():
                if name != "hf":
                    entry.update(_compare(decoder, ids, reference, entry["tokens"]))
        rows.append(row)
        log(f"[{index + 1}/{len(prompts)}] " + "  ".join(
            f"{name} {row['methods'][name]['decode_tokens_per_second']:.2f} tok/s" for name in names))
        if repricing is not None:
            repricing.timer.run(REPRICE_PASSES)
    report = _report(decoder, request, rows, names)
    if repricing is not None:
        report["prediction"]["repriced"] = repricing.report(report["summary"])
    elsewhere = profiled_elsewhere(decoder.plan, str(decoder.target_forward.device)) if decoder.plan else None
    if elsewhere:
        report["prediction"]["profiled_elsewhere"] = elsewhere
    planned_context = getattr(decoder.plan.settings, "context", None) if decoder.plan else None
    if request.context is not None and planned_context is not None and planned_context != request.context:
        report["prediction"]["planned_context"] = planned_context
    write_json(output, report, indent=None)  # a line per token would make it 5x longer; the .md is the view
    markdown = output.with_suffix(".md")
    with atomic_output(markdown) as handle:
        handle.write(markdown_table(report) + "\n")
    plot_report(report, output.with_suffix(".png"))
    return report


def _methods(decoder: Decoder, request: BenchRequest, context: int
             ) -> tuple[dict[str, Callable], list[SpeculativeEngine]]:
    """The methods to run, by name, and the engines of ours among them."""
    params = request.params
    device = decoder.target_forward.device
    hf_model = decoder.target.transformers_model().to(device)  # the baselines run where our decoder runs
    hf_draft = decoder.draft.transformers_model().to(device) if decoder.draft is not None else None
    stops_set = decoder.target.stop_token_ids
    stops = sorted(stops_set)
    pad = decoder.tokenizer.pad_token_id if decoder.tokenizer.pad_token_id is not None else stops[0]

    def hf(extra: dict) -> Callable:
        def run(ids, max_new, seed):
            torch.manual_seed(seed)
            sampling = {"do_sample": False} if params.greedy else {
                "do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
            tensor = torch.tensor([ids], device=device)
            clock = _FirstTokensClock()
            with torch.inference_mode():
                out = hf_model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=max_new,
                                        eos_token_id=stops, pad_token_id=pad, streamer=clock, **sampling, **extra)
            tokens = out[0, len(ids):].tolist()
            return tokens, {"decode": clock.decode(len(tokens))}
        return run

    def engine_method(engine: SpeculativeEngine) -> Callable:
        def run(ids, max_new, seed):
            result = engine.generate(ids, max_new, params, seed)
            return result.tokens, {"tokens_per_step": result.tokens_per_step, "steps": result.steps,
                                   "prefill_seconds": result.prefill_seconds,
                                   "decode": (len(result.tokens), result.decode_seconds)}
        return run

    ar_engine = SpeculativeEngine(decoder.target_forward, None, stops_set)
    engines = {"ours": decoder.engine, "ours-ar": ar_engine}
    triforce = {}
    if decoder.plan is not None and decoder.plan.method == "triforce":
        from specplan.core.method_settings import RetrievalSettings
        from specplan.decoder.drafters import NoDrafter
        from specplan.decoder.triforce import HierarchicalDrafter, StreamingDrafter

        s = decoder.plan.settings
        # The two-level variant at its own best settings where the planner recorded them, else at the plan's.
        two = {**s.to_dict(), **decoder.plan.prediction.details.get("best_two_level", {})}
        retrieval = RetrievalSettings(two["budget"], two["chunk"], two["stride"], s.rebuild_below)
        # The streaming draft likewise at its best gamma, where the acceptance file measured it.
        streaming_gamma = decoder.plan.prediction.details.get("best_streaming", {}).get("gamma2", s.gamma2)
        streaming_model = decoder.draft_forward or decoder.target_forward
        two_level = SpeculativeEngine(decoder.target_forward, HierarchicalDrafter(
            decoder.target_forward, NoDrafter(), 1, two["gamma2"], retrieval), stops_set)
        streaming = SpeculativeEngine(decoder.target_forward, StreamingDrafter(
            streaming_model, streaming_gamma, s.sinks, s.window), stops_set)
        triforce = {"two-level": engine_method(two_level), "streaming": engine_method(streaming)}
        engines |= {"two-level": two_level, "streaming": streaming}

    llama = {}
    for name, lookup, chain in (("llama.cpp", None, None), ("llama.cpp-lookup", request.prompt_lookup, None),
                                ("llama.cpp-draft", None, _llama_draft_chain(decoder))):
        if name in request.baselines:
            runner = LlamaCpp(decoder.target, context, lookup, chain)
            llama[name] = lambda ids, max_new, seed, runner=runner: runner.generate(ids, max_new, params, seed)

    available = {
        **triforce,
        **llama,
        "ours": lambda ids, max_new, seed: engine_method(decoder.engine)(ids, max_new, seed),  # after restart()
        "ours-ar": engine_method(ar_engine),
        "hf": hf({}),
        "hf-assisted": hf({"assistant_model": hf_draft}) if hf_draft is not None else None,
        "hf-prompt-lookup": hf({"prompt_lookup_num_tokens": request.prompt_lookup.num_tokens,
                                "max_matching_ngram_size": request.prompt_lookup.max_ngram}),
    }
    names = ["ours"] + [b for b in BASELINES if b in request.baselines]
    return {name: available[name] for name in names}, [engines[name] for name in names if name in engines]


def _llama_draft_chain(decoder: Decoder) -> DraftChainSettings | None:
    """The knobs of a plan solved for llama.cpp's draft-model speculation, with its draft; None for another plan."""
    plan = decoder.plan
    if plan is None or plan.engine != "llama.cpp" or decoder.draft is None:
        return None
    chain = Fields(plan.solver, f"{plan.source}: solver").sub("chain_knobs", required=False)
    if chain is None:
        return None
    knobs = chain.sub("best")  # where the plan drafts nothing, its best setting: the prediction is checked all the same
    return DraftChainSettings(decoder.draft, knobs.integer("draft_max", low=1), knobs.integer("draft_min", low=0),
                              knobs.number("p_min", low=0.0, high=1.0))


class _FirstTokensClock:
    """A transformers streamer that notes when the first new tokens come out: `put` gets the prompt first,
    then the new tokens, one or (assisted) several at a time."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_tokens = 0
        self.first_time = 0.0
        self.end_time = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_time = time.perf_counter()
            self.first_tokens = value.numel()

    def end(self) -> None:
        self.end_time = time.perf_counter()

    def decode(self, new_tokens: int) -> tuple[int, float]:
        if self.calls < 2:
            return 0, 0.0
        return new_tokens - self.first_tokens, self.end_time - self.first_time


def first_difference(tokens: list[int], reference: list[int]) -> int:
    """The index of the first token where two different outputs part (the shorter's length if one extends the
    other)."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


@torch.inference_mode()
def _compare(decoder: Decoder, prompt: list[int], reference: list[int], tokens: list[int]) -> dict:
    if tokens == reference:
        return {"identical_to_hf": True}
    first = first_difference(tokens, reference)
    gap = None
    if first < min(len(tokens), len(reference)):
        ids = torch.tensor([prompt + reference[:first]], device=decoder.target_forward.device)
        logits = decoder.target.transformers_model()(ids).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        gap = float(top[0] - top[1])
    return {"identical_to_hf": False, "first_difference": first, "top2_logit_gap": gap,
            "near_tie": gap is not None and gap < NEAR_TIE}


def summarize(rows: list[dict], names: list[str]) -> dict:
    """Per method over the rows (prompts): rates, tokens/step, HF identity and the ratios to the baselines."""
    summary = {}
    for name in names:
        entries = [row["methods"][name] for row in rows]
        tokens = sum(e["new_tokens"] for e in entries)
        seconds = sum(e["seconds"] for e in entries)
        decode_seconds = sum(e["decode_seconds"] for e in entries)
        summary[name] = {"tokens_per_second": tokens / seconds, "new_tokens": tokens, "seconds": seconds,
                         "decode_tokens_per_second": _rate(sum(e["decode_tokens"] for e in entries), decode_seconds),
                         "per_prompt_tokens_per_second_mean": float(np.mean([e["tokens_per_second"] for e in entries]))}
        if "tokens_per_step" in entries[0]:
            summary[name]["tokens_per_step"] = sum(e["new_tokens"] for e in entries) / sum(e["steps"] for e in entries)
        if "identical_to_hf" in entries[0]:
            summary[name]["identical_to_hf"] = sum(e["identical_to_hf"] for e in entries)
            summary[name]["near_tie_divergences"] = sum(bool(e.get("near_tie")) for e in entries)
            summary[name]["compared"] = len(entries)
    for name in names:
        for base in BASELINES:
            if base in summary and base != name:
                summary[name][f"speedup_vs_{base}"] = _ratio(summary[name], summary[base], "decode_tokens_per_second")
                summary[name][f"end_to_end_speedup_vs_{base}"] = _ratio(summary[name], summary[base],
                                                                        "tokens_per_second")
    return summary


def _report(decoder: Decoder, request: BenchRequest, rows: list[dict], names: list[str]) -> dict:
    summary = summarize(rows, names)
    plan = decoder.plan
    prediction = {}
    if plan is not None:
        prediction = {"plan_tokens_per_step": plan.prediction.tokens_per_step,
                      "plan_speedup": plan.prediction.speedup,
                      "measured_tokens_per_step": summary["ours"].get("tokens_per_step")}
        if "ours-ar" in summary:
            prediction["measured_speedup_vs_ours_ar"] = summary["ours"]["speedup_vs_ours-ar"]
            if prediction["plan_speedup"]:
                prediction["measured_over_predicted"] = (prediction["measured_speedup_vs_ours_ar"]
                                                         / prediction["plan_speedup"])
        if plan.engine == "llama.cpp" and "llama.cpp-draft" in summary and "llama.cpp" in summary:
            # a plan for llama.cpp's draft-model speculation, priced on llama.cpp's profile: run there
            entries = [row["methods"]["llama.cpp-draft"] for row in rows]
            measured = summary["llama.cpp-draft"]["speedup_vs_llama.cpp"]
            best = plan.solver["chain_knobs"]["best"]
            prediction["llama_cpp_draft"] = {
                "knobs": {key: best[key] for key in ("draft_max", "draft_min", "p_min")},
                "predicted_speedup": best["speedup"], "predicted_tokens_per_step": best["tokens_per_step"],
                "measured_speedup_vs_llama.cpp": measured,
                "measured_over_predicted": measured / best["speedup"],
                "measured_tokens_per_step": (sum(e["decode_tokens"] for e in entries)
                                             / max(1, sum(e["decode_forwards"] for e in entries)))}
        for method, key in (("two-level", "best_two_level"), ("streaming", "best_streaming")):
            best = plan.prediction.details.get(key)
            if best and method in summary and "ours-ar" in summary:
                prediction[method.replace("-", "_")] = {
                    "predicted_speedup": best["speedup"], "predicted_tokens_per_step": best["tokens_per_step"],
                    "measured_speedup_vs_ours_ar": summary[method]["speedup_vs_ours-ar"],
                    "measured_tokens_per_step": summary[method].get("tokens_per_step")}
    lookup_plan = request.lookup_plan
    if lookup_plan is not None:
        one_token, lookup = LOOKUP_BASELINES[lookup_plan.engine]
        details = lookup_plan.prediction.details
        # the lookup baseline runs the plan's knobs; for a plan that turned the lookup off, the best setting's
        # prediction (the plan itself is the one-token baseline)
        prediction = {"plan_tokens_per_step": details.get("lookup_tokens_per_step",
                                                          lookup_plan.prediction.tokens_per_step),
                      "plan_speedup": details.get("lookup_speedup", lookup_plan.prediction.speedup),
                      "lookup_enabled": lookup_plan.settings.enabled}
        entries = [row["methods"][lookup] for row in rows if lookup in row["methods"]]
        if entries and "decode_forwards" in entries[0]:
            prediction["measured_tokens_per_step"] = (sum(e["decode_tokens"] for e in entries)
                                                      / max(1, sum(e["decode_forwards"] for e in entries)))
        if one_token in summary and lookup in summary:
            measured = summary[lookup][f"speedup_vs_{one_token}"]
            prediction[f"measured_speedup_vs_{one_token}"] = measured
            if prediction["plan_speedup"]:
                prediction["measured_over_predicted"] = measured / prediction["plan_speedup"]
    return {
        "kind": "bench/report",
        "version": FORMAT_VERSION,
        "machine": {**cpu_info(), **this_machine(str(decoder.target_forward.device)), "torch": torch.__version__,
                    "platform": platform.platform()},
        "models": {"target": decoder.target.name, "draft": decoder.draft.name if decoder.draft else None,
                   "dtype": decoder.target.dtype, "draft_dtype": decoder.draft.dtype if decoder.draft else None,
                   **({"draft_vocab": plan.models.draft_vocab} if plan and plan.models.draft_vocab else {}),
                   "backend": decoder.target_forward.backend,
                   "cpu_kernels": getattr(decoder.target_forward, "kernels", None) is not None},
        "plan": {"kind": plan.kind, "prediction": plan.prediction.to_dict(),
                 "tree_size": plan.tree.size if plan.tree else None} if plan else (
            {"kind": lookup_plan.kind, "engine": lookup_plan.engine, "prediction": lookup_plan.prediction.to_dict(),
             "settings": lookup_plan.settings.to_dict()} if lookup_plan else None),
        "sampling": {"temperature": request.params.temperature, "top_p": request.params.top_p,
                     "top_k": request.params.top_k},
        "dataset": request.dataset, "context": request.context, "one_document": request.one_document,
        "prompts": len(rows), "max_new_tokens": request.max_new_tokens,
        "summary": summary, "prediction": prediction, "per_prompt": rows,
    }


def _plan_profile(plan: Plan) -> LatencyProfile:
    profile_file = plan.inputs.get("profile", {}).get("file")
    if not profile_file:
        raise UserError("--reprice needs a plan solved with a latency profile")
    check_unchanged(plan.provenance, profile_file, "the plan's profile")
    return load_profile(profile_file, TIMED_FORWARDS)


def _price_ratio(fresh: LatencyProfile, profiled: LatencyProfile,
                 price: Callable[[LatencyProfile], float | None]) -> float | None:
    """A price re-timed beside the run over the profile's (None where either lacks it)."""
    new, old = price(fresh), price(profiled)
    return None if new is None or old is None else float(new) / float(old)


def _repriced(timer: Any, summary: dict, prices: dict) -> dict:
    """A re-pricing's report: its `prices` (speedup, tokens_per_step, profiled_speedup, price_ratios, ...), the
    passes and points the `timer` (profiler.latency.PointTimer) ran, and the measured speedup over the re-priced
    one where ours-ar ran."""
    out = {**prices, "passes": len(next(iter(timer.samples.values()))), "points": len(timer.calls)}
    if "ours-ar" in summary:
        out["measured_over_repriced"] = summary["ours"]["speedup_vs_ours-ar"] / out["speedup"]
    return out


def _repricing(decoder: Decoder) -> _TriForceRepricing | _SequoiaRepricing | _LookaheadRepricing:
    plan = decoder.plan
    if plan is not None and plan.method == "triforce":
        return _TriForceRepricing(decoder)
    if plan is not None and plan.method == "sequoia":
        return _SequoiaRepricing(decoder)
    if plan is not None and plan.method == "lookahead":
        return _LookaheadRepricing(decoder)
    raise UserError("--reprice needs a TriForce, Sequoia or Lookahead plan")


class _LookaheadRepricing:
    """`--reprice` for a Lookahead plan: t(n) at every profiled context, for the profiled sizes up to the first
    that covers its largest tree, re-timed between the prompts; the trie's replay over the plan's acceptance file
    priced on them as the solver prices it (planner.lookahead.predicted_speedup, with the trie's time per step the
    plan recorded)."""

    def __init__(self, decoder: Decoder) -> None:
        from specplan.planner.lookahead import replay, solved_records
        from specplan.profiler.latency import PointTimer

        plan = decoder.plan
        self.plan = plan
        self.profile = _plan_profile(plan)
        acceptance_file = plan.inputs["acceptance"]["file"]
        check_unchanged(plan.provenance, acceptance_file, "the plan's acceptance file")
        replayed = replay(solved_records(plan), plan.settings)
        trie_per_step = plan.prediction.details.get("trie_seconds", replayed.trie_seconds / replayed.steps)
        self.replay = dataclasses.replace(replayed, trie_seconds=trie_per_step * replayed.steps)
        largest = int(max(replayed.step_sizes))
        curves = self.profile.target_by_context or {self.profile.target_context: self.profile.target_t_seconds}
        self.sizes: dict[int, list[int]] = {}
        for context, curve in curves.items():
            profiled = sorted(curve)
            covering = next((n for n in profiled if n >= largest), profiled[-1])
            self.sizes[context] = [n for n in profiled if n <= covering]
        self.timer = PointTimer(decoder.target_forward, None, self.sizes, {}, [])

    def report(self, summary: dict) -> dict:
        from specplan.planner.lookahead import predicted_speedup

        fresh = self.profile.with_points(*self.timer.medians())
        L = min(self.sizes)
        largest = self.sizes[L][-1]
        ratios = {"one_token": _price_ratio(fresh, self.profile, lambda p: p.latency(1, L)),
                  f"verify_{largest}": _price_ratio(fresh, self.profile, lambda p: p.latency(largest, L))}
        return _repriced(self.timer, summary, {
            "speedup": predicted_speedup(self.replay, fresh)[0], "tokens_per_step": self.replay.tokens_per_step,
            "profiled_speedup": predicted_speedup(self.replay, self.profile)[0], "price_ratios": ratios})


class _SequoiaRepricing:
    """`--reprice` for a Sequoia plan: t(1) and t(n) of its tree and the draft's step, at the plan's context,
    re-timed between the prompts, and the plan's tokens/step priced on them (planner.sequoia.plan_speedup; the
    draft's prompt prefill stays at its profiled price: about a tenth of a token's, timed once per pass it would
    cost more than the rest)."""

    def __init__(self, decoder: Decoder) -> None:
        from specplan.profiler.latency import PointTimer

        plan = decoder.plan
        if plan.engine != "specplan":
            raise UserError("--reprice prices a tree our decoder runs (solved with --engine specplan)")
        if plan.tree.size < 2:
            raise UserError("--reprice: this plan decodes one token per step, its price is one-token decoding's")
        self.plan = plan
        self.profile = _plan_profile(plan)
        self.context = plan.inputs["profile"]["context"]
        if self.context is None:
            raise UserError("--reprice needs a plan whose profile was measured at a known context")
        self.timer = PointTimer(decoder.target_forward, decoder.draft_forward, {self.context: [1, plan.tree.size]},
                                {}, [self.context])

    def report(self, summary: dict) -> dict:
        from specplan.planner.sequoia import plan_speedup

        fresh = self.profile.with_points(*self.timer.medians())
        L, n = self.context, self.plan.tree.size
        ratios = {"one_token": _price_ratio(fresh, self.profile, lambda p: p.step_seconds(1, L)),
                  f"verify_{n}": _price_ratio(fresh, self.profile, lambda p: p.step_seconds(n, L)),
                  "draft_step": _price_ratio(fresh, self.profile, lambda p: p.draft_step(L))}
        return _repriced(self.timer, summary, {
            "speedup": plan_speedup(self.plan, fresh), "tokens_per_step": self.plan.prediction.tokens_per_step,
            "profiled_speedup": plan_speedup(self.plan, self.profile), "price_ratios": ratios})


class _TriForceRepricing:
    """`--reprice`: the forwards and builds a TriForce plan's prediction priced, at the profile's own points,
    re-timed between the prompts of the run (a streaming drafter's window prefill, which the prediction charges
    once per prompt, included). On a VM whose speed drifts, the prediction re-priced with them separates a
    model error from a machine that runs slower or faster than when it was profiled."""

    def __init__(self, decoder: Decoder) -> None:
        from specplan.planner.triforce_reprice import priced_points
        from specplan.profiler.latency import PointTimer

        plan = decoder.plan
        self.plan = plan
        self.profile = _plan_profile(plan)
        points = priced_points(plan, self.profile)
        draft = decoder.draft_forward if points.draft or points.window_prefill == "draft" else None
        self.draft_priced = bool(points.draft)
        window_prefill = (points.window_prefill, plan.settings.sinks, plan.settings.window) \
            if points.window_prefill else None
        self.timer = PointTimer(decoder.target_forward, draft, points.target, points.builds, points.draft,
                                window_prefill)

    def report(self, summary: dict) -> dict:
        from specplan.planner.triforce_reprice import reprice

        fresh = self.profile.with_points(*self.timer.medians())
        profiled, profiled_two = reprice(self.plan, self.profile)
        repriced, repriced_two = reprice(self.plan, fresh)
        s = self.plan.settings
        L, middle = s.context, s.budget + s.chunk
        top = min(round(profiled.chain_tokens) + 1, max(fresh.target_curve(L).points))

        def ratio(price: Callable[[LatencyProfile], float | None]) -> float | None:
            return _price_ratio(fresh, self.profile, price)

        ratios = {"one_token_at_context": ratio(lambda p: p.latency(1, L)),
                  f"top_verify_{top}_at_context": ratio(lambda p: p.latency(top, L)),
                  "middle_step": ratio(lambda p: p.latency(profiled.gamma1 + 1, middle)),
                  "retrieval_build": ratio(lambda p: p.retrieval_build(L, s.budget))}
        if self.draft_priced:
            ratios["draft_step"] = ratio(lambda p: p.draft_step(s.sinks + s.window))
        if self.timer.window_prefill_role:
            ratios["window_prefill"] = ratio(lambda p: p.window_prefill(self.timer.window_prefill_role, s.sinks,
                                                                        s.window))
        prices = {"speedup": repriced.speedup, "tokens_per_step": repriced.tokens_per_step,
                  "profiled_speedup": profiled.speedup, "two_level_speedup": repriced_two.speedup,
                  "two_level_profiled_speedup": profiled_two.speedup,
                  "price_ratios": {key: value for key, value in ratios.items() if value is not None}}
        if not s.speculate:  # the plan decodes one token per step; what was re-priced is its best setting
            prices.update({"speedup": 1.0, "tokens_per_step": 1.0, "profiled_speedup": 1.0,
                           "best_speculative_speedup": repriced.speedup,
                           "best_speculative_profiled_speedup": profiled.speedup})
        out = _repriced(self.timer, summary, prices)
        if "ours-ar" in summary and "two-level" in summary:
            out["two_level_measured_over_repriced"] = (summary["two-level"]["speedup_vs_ours-ar"]
                                                       / repriced_two.speedup)
        return out


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def _ratio(method: dict, base: dict, rate: str) -> float:
    return method[rate] / base[rate] if base[rate] > 0 else float("nan")


def markdown_table(report: dict) -> str:
    models = report["models"]
    summary = report["summary"]
    bases = [b for b in BASELINES if b in summary]
    lines = [f"{models['target']} ({models['dtype']})"
             + (f", draft {models['draft']} ({models['draft_dtype']}"
                + (f", ids < {models['draft_vocab']}" if models.get("draft_vocab") else "") + ")"
                if models["draft"] else "")
             + f"; {report['prompts']} prompts from {report['dataset']}, {report['max_new_tokens']} new tokens, "
             f"T = {report['sampling']['temperature']}",
             "",
             "| method | decode tokens/s | " + " | ".join(f"vs {b}" for b in bases)
             + " | end-to-end tokens/s | end-to-end vs hf | tokens/step | identical to hf |",
             "|---|---|" + "---|" * len(bases) + "---|---|---|---|"]
    for name, s in summary.items():
        identical = f"{s['identical_to_hf']}/{s['compared']}" + (
            f" ({s['near_tie_divergences']} near-tie)" if s.get("near_tie_divergences") else "") \
            if "identical_to_hf" in s else ""
        ratios = " | ".join(f"{_ratio(s, summary[b], 'decode_tokens_per_second'):.2f}x" for b in bases)
        end_to_end = f"{_ratio(s, summary['hf'], 'tokens_per_second'):.2f}x" if "hf" in summary else ""
        per_step = f"{s['tokens_per_step']:.2f}" if "tokens_per_step" in s else (
            "1.00" if name == "hf" else "n/a")  # transformers does not report its steps
        lines.append(f"| {name} | {s['decode_tokens_per_second']:.2f} | {ratios} | {s['tokens_per_second']:.2f} | "
                     f"{end_to_end} | {per_step} | {identical} |")
    prediction = report.get("prediction") or {}
    plan = report.get("plan") or {}
    if prediction.get("plan_speedup") and plan.get("engine"):  # an engine's prompt lookup, against its one token
        one_token, lookup = LOOKUP_BASELINES[plan["engine"]]
        measured = prediction.get(f"measured_speedup_vs_{one_token}")
        per_step = prediction.get("measured_tokens_per_step")
        lines.append("")
        lines.append(f"plan ({lookup}, {plan['settings']}): predicted {prediction['plan_speedup']:.2f}x at "
                     f"{prediction['plan_tokens_per_step']:.2f} tokens/step; measured "
                     + (f"{measured:.2f}x" if measured is not None else "?")
                     + (f" at {per_step:.2f} tokens/step" if per_step is not None else "") + f" (vs {one_token})")
        if not prediction.get("lookup_enabled", True):
            lines.append(f"the plan turns the lookup off (no setting was predicted faster than {one_token}): "
                         f"it runs as {one_token}")
    elif prediction.get("plan_speedup"):
        lines.append("")
        measured = prediction.get("measured_speedup_vs_ours_ar")
        lines.append(f"plan: predicted {prediction['plan_speedup']:.2f}x at {prediction['plan_tokens_per_step']:.2f} "
                     "tokens/step; measured "
                     + (f"{measured:.2f}x at " if measured is not None else "")
                     + f"{prediction['measured_tokens_per_step']:.2f} tokens/step"
                     + (" (vs ours-ar)" if measured is not None else " (ours-ar not run: no measured speedup)"))
        draft_chain = prediction.get("llama_cpp_draft")
        if draft_chain:
            lines.append(f"llama.cpp-draft ({draft_chain['knobs']}, in llama-cpp-python): predicted "
                         f"{draft_chain['predicted_speedup']:.2f}x at {draft_chain['predicted_tokens_per_step']:.2f} "
                         f"tokens/step; measured {draft_chain['measured_speedup_vs_llama.cpp']:.2f}x vs llama.cpp at "
                         f"{draft_chain['measured_tokens_per_step']:.2f} tokens/step ("
                         f"{draft_chain['measured_over_predicted']:.2f} of the prediction)")
        speculative = (report.get("plan") or {}).get("prediction", {}).get("best_speculative")
        if speculative:
            lines.append(f"the plan decodes one token per step: its best speculative setting was predicted "
                         f"{speculative['speedup']:.2f}x at {speculative['tokens_per_step']:.2f} tokens/step")
        for method in ("two-level", "streaming"):
            best = prediction.get(method.replace("-", "_"))
            if best:
                lines.append(f"{method} at its best settings: predicted {best['predicted_speedup']:.2f}x at "
                             f"{best['predicted_tokens_per_step']:.2f} tokens/step; measured "
                             f"{best['measured_speedup_vs_ours_ar']:.2f}x at "
                             f"{best['measured_tokens_per_step']:.2f} tokens/step (vs ours-ar)")
        repriced = prediction.get("repriced")
        if repriced:
            measured_over = repriced.get("measured_over_repriced")
            lines.append(f"re-priced with its {repriced['points']} priced forwards and builds re-timed beside the "
                         f"run ({repriced['passes']} passes): predicted {repriced['speedup']:.2f}x"
                         + (f" (one token per step; the best speculative setting {best:.2f}x)"
                            if (best := repriced.get("best_speculative_speedup")) is not None else "")
                         + (f", measured/predicted {measured_over:.2f}" if measured_over is not None else "")
                         + (f"; two-level {repriced['two_level_speedup']:.2f}x" if "two_level_speedup" in repriced
                            else "")
                         + (f", measured/predicted {repriced['two_level_measured_over_repriced']:.2f}"
                            if "two_level_measured_over_repriced" in repriced else ""))
            lines.append("times now against the profile's: " + ", ".join(
                f"{key.replace('_', ' ')} {value:.2f}x" for key, value in repriced["price_ratios"].items()))
        if prediction.get("planned_context"):
            lines.append(f"note: the plan was solved for {prediction['planned_context']}-token prompts and these hold "
                         f"{report['context']}: its prediction is for {prediction['planned_context']}")
        if prediction.get("profiled_elsewhere"):
            lines.append(f"note: the plan's profile was measured on another machine "
                         f"({prediction['profiled_elsewhere']}): the prediction is for that one")
    return "\n".join(lines)


def load_report(path: str | Path) -> dict:
    """A `plan bench` report (JSON), checked for the fields that tables and plots read."""
    report = read_json(path)
    if report.get("kind") != "bench/report":
        raise UserError(f"{path}: not a plan bench report (kind {report.get('kind')!r})")
    Fields(report, str(path)).version()
    summary, models = report.get("summary"), report.get("models")
    if not (isinstance(summary, dict) and summary and isinstance(models, dict) and "target" in models
            and all(isinstance(m, dict) and isinstance(m.get("decode_tokens_per_second"), (int, float))
                    for m in summary.values())):
        raise UserError(f"{path}: a bench report needs models.target and a summary of decode tokens/s per method")
    number = (int, float)
    for method, rates in summary.items():
        for key in ("tokens_per_second", "tokens_per_step", "identical_to_hf", "compared", "near_tie_divergences"):
            if (key == "tokens_per_second" or key in rates) and (
                    not isinstance(rates.get(key), number) or isinstance(rates.get(key), bool)):
                raise UserError(f"{path}: summary.{method}.{key} must be a number")
    sampling = report.get("sampling")
    if not isinstance(sampling, dict) or not isinstance(sampling.get("temperature"), number):
        raise UserError(f"{path}: a bench report needs sampling.temperature")
    for key in ("prediction", "plan"):
        if report.get(key) is not None and not isinstance(report[key], dict):
            raise UserError(f"{path}: {key} must be a mapping")
    return report


def report_label(report: dict) -> str:
    """e.g. "Lookahead, smollm2-135m fp32", "Sequoia, qwen2.5-coder-1.5b + 0.5b bf16", "TriForce 7680, ..."."""
    models, plan = report["models"], report.get("plan") or {}
    method = {"plan/sequoia": "Sequoia", "plan/lookahead": "Lookahead", "plan/triforce": "TriForce"}.get(
        plan.get("kind"), "one-token")
    context = f" {report['context']}" if report.get("context") else ""
    draft = models.get("draft") or ""
    shared = os.path.commonprefix([models["target"], draft]).rpartition("-")[0]  # qwen2.5-coder-1.5b + 0.5b
    pair = models["target"] + (f" + {draft[len(shared) + 1:] if shared else draft}" if draft else "")
    return f"{method}{context}, {pair} {models.get('dtype', '')}".strip()


METHOD_COLORS = {"ours": "tab:red", "ours-ar": "tab:gray", "hf-assisted": "tab:blue", "hf-prompt-lookup": "tab:cyan",
                 "two-level": "tab:orange", "streaming": "tab:olive"}
PREDICTION_BAND = 0.10  # the planner's accuracy target: measured within 10% of predicted


def plot_summary(reports: list[dict], png: Path) -> None:
    """Left: every method's decode speedup over transformers' greedy generate, one group of bars per report.
    Right: the plan's predicted speedup over our one-token decoding against the measured one."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.9 * len(reports) + 2.5),
                                      gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{index}. {report_label(r)}" for index, r in enumerate(reports, 1)]
    height = 0.8 / len(METHOD_COLORS)
    shown: set[str] = set()
    for row, report in enumerate(reports):
        summary = report["summary"]
        if "hf" not in summary:
            continue
        present = [m for m in METHOD_COLORS if m in summary]
        for slot, method in enumerate(present):
            value = _ratio(summary[method], summary["hf"], "decode_tokens_per_second")
            y = row + (slot - (len(present) - 1) / 2) * height
            left.barh(y, value, height * 0.9, color=METHOD_COLORS[method],
                      label=None if method in shown else ("ours (the plan)" if method == "ours" else method))
            left.text(value, y, f" {value:.2f}x", va="center", fontsize=7)
            shown.add(method)
    left.axvline(1.0, color="black", lw=0.8)
    left.set_xlim(0, left.get_xlim()[1] * 1.12)  # room for the values
    left.set_yticks(range(len(reports)), labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("decode tokens/s over transformers greedy (same run)")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 1.0 + 0.6 / (len(reports) + 2)), ncol=6,
                frameon=False)
    left.grid(alpha=0.3, axis="x")

    points = [(r["prediction"]["plan_speedup"], r["prediction"]["measured_speedup_vs_ours_ar"], str(index))
              for index, r in enumerate(reports, 1)
              if (r.get("prediction") or {}).get("plan_speedup") and "measured_speedup_vs_ours_ar" in r["prediction"]]
    if points:
        top = max(max(p, m) for p, m, _ in points) * 1.1
        line = np.array([0.8, top])
        right.plot(line, line, color="black", lw=0.8)
        right.fill_between(line, line * (1 - PREDICTION_BAND), line * (1 + PREDICTION_BAND), color="gray", alpha=0.2,
                           label=f"within {PREDICTION_BAND:.0%}")
        for predicted, measured, label in points:
            right.scatter(predicted, measured, color="tab:red", zorder=3)
            right.annotate(label, (predicted, measured), fontsize=8, xytext=(4, -3), textcoords="offset points")
        right.set_xlim(0.8, top)
        right.set_ylim(0.8, top)
        right.legend(fontsize=7, loc="upper left")
    right.set_xlabel("predicted speedup over our one-token decoding")
    right.set_ylabel("measured (points numbered as the rows on the left)")
    right.grid(alpha=0.3)
    machines = sorted({machine_label(r.get("machine") or {}) for r in reports})
    fig.suptitle("; ".join(machines), fontsize=9)
    fig.tight_layout()
    save_png(fig, png)


def plot_report(report: dict, png: Path) -> None:
    plt = pyplot()
    names = list(report["summary"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    per_prompt = [[row["methods"][n]["decode_tokens_per_second"] for row in report["per_prompt"]] for n in names]
    ax.boxplot(per_prompt, tick_labels=names, showmeans=True)
    ax.scatter(range(1, len(names) + 1), [report["summary"][n]["decode_tokens_per_second"] for n in names],
               color="black", zorder=5, label="aggregate decode tokens/s")
    ax.set_ylabel("decode tokens/s per prompt")
    ax.set_title(f"{report['models']['target']} ({report['models']['dtype']}), {report['prompts']} prompts")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    save_png(fig, png)
