"""`plan accept triforce`: how well each level of the TriForce hierarchy predicts the one above, on long prompts.

For each long prompt, the target (full cache) generates its own continuation. Then, for every (budget,
chunk, stride) on the grid, the middle level (the target over a retrieval cache built after the decoder's plain
first step, from that step root's query: the last prompt token's) is run over that continuation in segments of
`segment` tokens (or in the steps of the plan it was decoded with), teacher forced, with the segment's tokens
written over the lowest-ranked slots afterwards and rebuilds every `stride` tokens, as the decoder does. The first
token, which the decoder's plain step emits, is scored over a cache built before it. Per position, the
middle level's acceptance is 1[argmax p_hat = argmax p] at T = 0 and sum_x min(p, p_hat) otherwise; the
bottom drafter's acceptance against the middle level is measured the same way (the trie's first proposal, or
the draft model over a StreamingLLM cache). The continuation ends at a stop token, as decoding does. Each
entry keeps the means and, per prompt, both per-position traces, which `plan solve triforce` replays.

Per context, the StreamingLLM-only draft (no middle level: the draft model, or the target itself where the
bottom is a trie, over a cache of sinks + recent window, drafting straight for the full target) is measured
against the full target the same way, one trace per prompt: the planner weighs it against the hierarchy.

A trie bottom at T = 0 also records, for every gamma1 the planner searches, its accepted run at each position:
the decoder's own TrieDrafter with the plan's trie settings for that gamma1 (living across the prompts of a
context, as in `plan bench`) proposes a tree there, and the middle level's greedy walk through it follows the
middle's argmax rows, stopping after a token off the text (the rows beyond it were computed on the text). A
first-proposal trace cannot stand in for it: the decoder's tree per gamma1 accepts runs of other lengths,
and one step whose chain is a token shorter shifts every later step of a greedy replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import torch

from specplan.core import progress
from specplan.core.acceptance_schema import (
    TRIFORCE_DECODED_SETTINGS,
    TRIFORCE_GAMMA1,
    StreamingRecord,
    TriForceEntry,
    TriForceTrace,
)
from specplan.core.method_settings import STREAMING_SINKS, STREAMING_WINDOW, RetrievalSettings, TrieSettings
from specplan.core.model_names import model_name
from specplan.decoder.drafters import TrieDrafter
from specplan.decoder.model import LeanModel, causal_mask
from specplan.decoder.sampling import SamplingParams, probabilities, sample
from specplan.decoder.tree import DETERMINISTIC
from specplan.decoder.trie import Trie, accepted_run
from specplan.decoder.triforce import RetrievalCache, bottom_trie_settings
from specplan.profiler.haystack import LongPrompt


@dataclass(frozen=True)
class BottomSpec:
    kind: str  # "trie", "model" or "none"
    model: LeanModel | None = None
    sinks: int = STREAMING_SINKS
    window: int = STREAMING_WINDOW


def _agreement(upper: torch.Tensor, lower: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """Per row: probability that a token drawn from `lower` is accepted by `upper` (single-draft rule)."""
    if params.greedy:
        return (upper.argmax(-1) == lower.argmax(-1)).double().numpy()
    return torch.minimum(probabilities(upper, params), probabilities(lower, params)).sum(-1).double().numpy()


@torch.inference_mode()
def _continuation(target: LeanModel, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                  generator: torch.Generator, stop_ids: Collection[int], given: list[int] | None = None):
    """The target's own continuation with its full cache, up to and including a stop token, or the `given`
    one (teacher forced): (full cache, the target's logits per new token, tokens, the target's query per
    root: row k for the token at position len(prompt) - 1 + k, as a decoder's rebuild would score with)."""
    steps = max_new_tokens if given is None else len(given)
    full = target.new_cache(len(prompt) + steps + 1)
    target.prefill(torch.tensor(prompt[:-1]), full, logits=False)
    queries = torch.zeros(steps, target.shape.layers, target.shape.heads, target.shape.head_dim, dtype=target.dtype)
    root, rows, tokens = prompt[-1], [], []
    for step in range(steps):
        full.root_queries = queries[step]
        logits = target.forward(torch.tensor([root]), torch.tensor([full.length]), full, None)[0]
        full.commit(None, 1)
        rows.append(logits.float())
        if given is not None:
            root = given[step]
        elif params.greedy:
            root = int(logits.argmax())
        else:
            root = int(sample(probabilities(logits[None], params), generator))
        tokens.append(root)
        if given is None and root in stop_ids:
            break
    full.root_queries = None
    return full, torch.stack(rows), tokens, queries[:len(tokens)]


@torch.inference_mode()
def _middle_logits(target: LeanModel, full, prompt_length: int, sequence: list[int], queries: torch.Tensor,
                   settings: RetrievalSettings, segments: list[int]) -> torch.Tensor:
    """Teacher-forced middle-level logits for every continuation token (row i predicts continuation[i]), in
    `segments` (a decoder's steps: each is forwarded over the cache, then written into it). Rebuilds score
    with the target's query of the segment's first token: a decoder's step root. The first segment is the
    decoder's plain first step, one token: its row comes from a cache built before it, which it is not written
    into; the decoder's first build comes after it."""
    retrieval = RetrievalCache(target, settings, scratch=max(segments) + 1)
    committed = full.length
    start = prompt_length - 1
    full.length = start
    retrieval.build(full, queries[0])
    rows = [target.forward(torch.tensor(sequence[start:start + 1]), torch.tensor([start]), retrieval.cache,
                           None).float()]
    start = full.length = prompt_length
    retrieval.build(full, queries[0])
    end = len(sequence) - 1  # the last continuation token predicts nothing we score
    for segment in segments[1:]:
        if start >= end:
            break
        piece = sequence[start:min(start + segment, end)]
        n = len(piece)
        cache = retrieval.cache
        mask = causal_mask(cache.length, n, target.dtype, target.device) if n > 1 else None
        rows.append(target.forward(torch.tensor(piece), torch.arange(start, start + n), cache, mask).float())
        full.length = start + n
        if not retrieval.insert(full, start, start + n):
            retrieval.build(full, queries[start - (prompt_length - 1)])
        start += n
    full.length = committed
    return torch.cat(rows)


@torch.inference_mode()
def _bottom_logits_or_tokens(bottom: BottomSpec, sequence: list[int], prompt_length: int):
    """The bottom drafter's greedy-style proposals along the continuation (trie: first proposed token or -1;
    model: logits over a StreamingLLM cache)."""
    steps = len(sequence) - prompt_length
    if bottom.kind == "trie":
        trie = Trie(TrieSettings())
        array = np.array(sequence, dtype=np.int64)
        trie.insert(array, 0, prompt_length, from_prompt=True)
        proposals = []
        for i in range(steps):
            tokens, _ = trie.retrieve(array, prompt_length + i)
            proposals.append(int(tokens[1]) if len(tokens) > 1 else -1)
            trie.insert(array, prompt_length + i, prompt_length + i + 1)
        return proposals
    model = bottom.model
    context = sequence[:prompt_length - 1]
    kept = context[:bottom.sinks] + context[max(bottom.sinks, len(context) - bottom.window):]
    positions = list(range(min(bottom.sinks, len(context)))) + list(
        range(max(bottom.sinks, len(context) - bottom.window), len(context)))
    cache = model.new_cache(len(kept) + steps + 1)
    if kept:
        n = len(kept)
        model.forward(torch.tensor(kept), torch.tensor(positions), cache, causal_mask(0, n, model.dtype, model.device),
                      logits_rows=slice(0, 0))
        cache.commit(None, n)
    chain = sequence[prompt_length - 1:len(sequence) - 1]
    n = len(chain)
    return model.forward(torch.tensor(chain), torch.arange(prompt_length - 1, prompt_length - 1 + n), cache,
                         causal_mask(cache.length, n, model.dtype, model.device)).float()


def _trie_drafts(drafters: dict[int, TrieDrafter], prompt: list[int], continuation: list[int]
                ) -> dict[int, list[tuple[np.ndarray, np.ndarray]]]:
    """Per gamma1, the (tokens, parents) tree its decoder-side trie drafter proposes at each continuation
    position, fed the continuation one token at a time."""
    drafts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for gamma1, drafter in drafters.items():
        drafter.reset(prompt, len(prompt) + len(continuation) + 1)
        trees, root = [], prompt[-1]
        for token in continuation:
            tree = drafter.propose(root, SamplingParams(), DETERMINISTIC, None)
            trees.append((np.array(tree.tokens), np.array(tree.parents)))
            drafter.update(tree, [0], token)
            root = token
        drafts[gamma1] = trees
    return drafts


def _trie_runs(drafts: list[tuple[np.ndarray, np.ndarray]], middle_choice: np.ndarray,
               continuation: np.ndarray) -> str:
    """The middle level's greedy walk through each position's tree, as one digit per position."""
    length = len(middle_choice)
    next_miss = np.full(length + 1, length)
    for i in range(length - 1, -1, -1):
        next_miss[i] = i if middle_choice[i] != continuation[i] else next_miss[i + 1]
    runs = [min(accepted_run(tokens, parents, middle_choice[i:]), next_miss[i] - i + 1)
            for i, (tokens, parents) in enumerate(drafts[:length])]
    return "".join(str(run) for run in runs)


def measure_triforce(target: LeanModel, prompts: list[LongPrompt], grid: list[tuple[int, int, int]],
                     bottom: BottomSpec, max_new_tokens: int, params: SamplingParams, stop_ids: Collection[int],
                     segment: int = 8, seed: int = 0, log: Callable[[str], None] = progress.say,
                     decode: Callable[[list[int]], tuple[list[int], list[int]]] | None = None
                     ) -> tuple[list[TriForceEntry], list[StreamingRecord]]:
    """Acceptance entries per (context, budget, chunk, stride), and per context the StreamingLLM-only draft's
    record. With `decode` (greedy only), the continuation is the one it returns for a prompt instead of the
    target's one-token greedy text, and the middle level runs in the steps it returns (tokens emitted per step)
    instead of segments of `segment` tokens."""
    generator = torch.Generator().manual_seed(seed)
    samples: dict[tuple, dict[str, list]] = {}
    streaming: dict[int, list[np.ndarray]] = {}
    streaming_spec = bottom if bottom.kind == "model" else BottomSpec("model", target, bottom.sinks, bottom.window)
    trie_runs = bottom.kind == "trie" and params.greedy
    drafters = {gamma1: TrieDrafter(Trie(bottom_trie_settings(gamma1))) for gamma1 in TRIFORCE_GAMMA1} \
        if trie_runs else {}
    for prompt in prompts:
        started = time.perf_counter()
        given, steps = decode(prompt.ids) if decode is not None else (None, None)
        full, target_rows, continuation, queries = _continuation(target, prompt.ids, max_new_tokens, params,
                                                                 generator, stop_ids, given)
        sequence = prompt.ids + continuation
        segments = steps or [1] + [segment] * len(continuation)  # the decoder's first step is plain
        bottom_out = _bottom_logits_or_tokens(bottom, sequence, len(prompt.ids)) if bottom.kind != "none" else None
        drafts = _trie_drafts(drafters, prompt.ids, continuation) if trie_runs else {}
        streaming_rows = bottom_out if bottom.kind == "model" else _bottom_logits_or_tokens(
            streaming_spec, sequence, len(prompt.ids))
        streaming.setdefault(prompt.context, []).append(
            _agreement_with_top(target_rows, streaming_rows, continuation, params))
        for budget, chunk, stride in grid:
            settings = RetrievalSettings(budget, chunk, stride).check(len(prompt.ids))
            middle = _middle_logits(target, full, len(prompt.ids), sequence, queries, settings, segments)
            key = (prompt.context, budget, chunk, stride)
            entry = samples.setdefault(key, {"middle": [], "bottom": [], "bottom_runs": []})
            entry["middle"].append(_agreement_with_top(target_rows, middle, continuation, params))
            if bottom_out is None:
                entry["bottom"].append(np.ones(len(middle)))
                continue
            if bottom.kind == "trie":
                if trie_runs:
                    choice, text = middle.argmax(-1).numpy(), np.array(continuation)
                    entry["bottom_runs"].append([_trie_runs(drafts[gamma1], choice, text) for gamma1 in drafters])
                proposals = torch.tensor(bottom_out[:len(middle)])
                if params.greedy:
                    agree = (middle.argmax(-1) == proposals).double().numpy()
                else:
                    p_hat = probabilities(middle, params)
                    agree = torch.where(proposals >= 0, p_hat.gather(1, proposals.clamp(min=0)[:, None])[:, 0],
                                        torch.zeros(len(proposals))).double().numpy()
            else:
                agree = _agreement(middle, bottom_out[:len(middle)], params)
            entry["bottom"].append(agree)
        log(f"{prompt.id}: {len(prompt.ids)} prompt tokens, {len(grid)} settings in "
            f"{time.perf_counter() - started:.0f} s")
    entries = []
    for (context, budget, chunk, stride), values in samples.items():
        middle = np.concatenate(values["middle"])
        bottom_values = np.concatenate(values["bottom"])
        traces = [TriForceTrace(_trace(m, params), _trace(b, params))
                  for m, b in zip(values["middle"], values["bottom"])]
        for trace, runs in zip(traces, values["bottom_runs"]):
            trace.bottom_runs = np.array([[int(c) for c in run] for run in runs], dtype=np.int64)
        entries.append(TriForceEntry(context, budget, chunk, stride, float(middle.mean()), float(bottom_values.mean()),
                                     traces, {"middle_stderr": _stderr(middle), "bottom_stderr": _stderr(bottom_values),
                                              "positions": int(len(middle))}))
    drafter = "target" if bottom.kind != "model" else "draft"
    records = [StreamingRecord(context, drafter, float(np.concatenate(values).mean()),
                               [_trace(v, params) for v in values],
                               {"stderr": _stderr(np.concatenate(values)), "positions": sum(len(v) for v in values)})
               for context, values in streaming.items()]
    return entries, records


def _agreement_with_top(target_rows: torch.Tensor, lower: torch.Tensor, continuation: list[int],
                        params: SamplingParams) -> np.ndarray:
    """A drafting level's acceptance by the full target at each continuation position (row i of `lower`
    predicts continuation[i]): at T = 0 the top emits the continuation's tokens."""
    if params.greedy:
        return (lower.argmax(-1) == torch.tensor(continuation)).double().numpy()
    return _agreement(target_rows, lower, params)


def _stderr(values: np.ndarray) -> float:
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


def _trace(values: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Per-position acceptances as stored: 0/1 at T = 0, else probabilities to 4 decimals."""
    return values.astype(np.int64) if params.greedy else np.round(values.astype(np.float64), 4)


def run_triforce_acceptance(target_name: str, draft_name: str | None, bottom_kind: str, dataset: str,
                            contexts: list[int], samples: int, grid: list[tuple[int, int, int]], max_new_tokens: int,
                            params: SamplingParams, dtype: str, sinks: int, window: int, output: str,
                            log: Callable[[str], None] = progress.say, decode_with: str | None = None,
                            one_document: bool = False, seed: int = 0) -> dict:
    """With `decode_with` (a greedy TriForce plan), the continuations are that plan's decoded outputs: outside
    fp32 the text depends on the forward's size, and a replay over the target's one-token text predicts
    another text than the plan emits. The middle level then runs in the plan's own steps, so that its cache
    holds what the decoder's held at each position. The prompts are decoded as `plan bench` does (in order,
    one decoder). `one_document` and `seed` build the prompts as profiler/haystack.py's build_prompts does."""
    from specplan.core.acceptance_schema import TriForceAcceptance
    from specplan.core.errors import UserError
    from specplan.core.fileio import write_yaml
    from specplan.core.models import check_same_vocabulary, load_model
    from specplan.core.provenance import provenance
    from specplan.decoder.api import load_decoder, load_forward
    from specplan.profiler.haystack import build_prompts

    if bottom_kind == "model" and not draft_name:
        raise UserError("a model bottom needs a draft model")
    if sinks < 0 or window < 1:
        raise UserError(f"a StreamingLLM cache needs sinks >= 0 and a window >= 1 (got {sinks} and {window})")
    decoder = None
    if decode_with is not None:
        plan_settings = _check_triforce_plan(decode_with, target_name, dtype, params, contexts)
        decoder = load_decoder(decode_with, target=target_name, dtype=dtype, log=log)
        decoder.fix_setting(plan_settings["gamma2"] + 1)  # its own chain at every step: what its replay takes
        target = decoder.target
    else:
        target = load_model(target_name, dtype, log=log)
    limit = target.config.max_position_embeddings
    for context in contexts:
        if context + max_new_tokens > limit:
            raise UserError(f"context {context} plus {max_new_tokens} new tokens exceeds {target_name}'s "
                            f"maximum context of {limit}")
    for budget, chunk, stride in grid:
        RetrievalSettings(budget, chunk, stride).check(min(contexts))
    bottom = BottomSpec(bottom_kind, sinks=sinks, window=window)
    if bottom_kind == "model":
        draft = load_model(draft_name, dtype, log=log)
        check_same_vocabulary(target, draft)
        bottom = BottomSpec("model", load_forward(draft, "cpu", backend="lean"), sinks, window)
    lean = decoder.target_forward if decoder is not None else load_forward(target, "cpu", backend="lean")

    def decode(ids: list[int]) -> tuple[list[int], list[int]]:
        result = decoder.engine.generate(ids, max_new_tokens, SamplingParams())
        return result.tokens, result.accepted_per_step

    started = time.perf_counter()
    entries, streaming = [], []
    for context in contexts:
        prompts = build_prompts(dataset, target.tokenizer, context, samples, seed=seed, one_document=one_document)
        if decoder is not None:
            decoder.restart()  # as `plan bench` does before its prompts
        measured = measure_triforce(lean, prompts, grid, bottom, max_new_tokens, params, target.stop_token_ids,
                                    log=log, decode=decode if decoder is not None else None)
        entries += measured[0]
        streaming += measured[1]
    acceptance = TriForceAcceptance(
        target=target.name, bottom=model_name(draft_name) if bottom_kind == "model" else bottom_kind,
        entries=entries,
        temperature=params.temperature, streaming=streaming, bottom_cache=(sinks, window),
        decoded_with=None if decoder is None else {"plan": decode_with, **plan_settings},
        extra={"dtype": dtype, "top_p": params.top_p, "max_new_tokens": max_new_tokens,
               "dataset": {"path": dataset, "contexts": contexts, "prompts_per_context": samples,
                           **({"one_document": True} if one_document else {}), **({"seed": seed} if seed else {})},
               "seconds": round(time.perf_counter() - started, 1), "provenance": provenance()})
    document = acceptance.to_dict()
    write_yaml(output, document)
    return document


def _check_triforce_plan(plan_path: str, target_name: str, dtype: str, params: SamplingParams,
                         contexts: list[int]) -> dict:
    """The plan's decoding settings, after checking it can decode these prompts greedily."""
    from specplan.core.errors import UserError
    from specplan.core.plan_schema import load_decoding_plan

    plan = load_decoding_plan(plan_path, "triforce", target_name, dtype)
    if not params.greedy or float(plan.sampling.get("temperature", 0.0)) != 0.0:
        raise UserError("replaying a plan's decoding is greedy only: a T = 0 plan and temperature 0")
    settings = plan.settings
    if not settings.speculate:
        raise UserError(f"{plan_path} decodes one token per step (speculate: false): no speculative decoding to "
                        "replay")
    for context in contexts:
        settings.retrieval().check(context)
    return {key: getattr(settings, key) for key in TRIFORCE_DECODED_SETTINGS}
