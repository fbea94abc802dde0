"""`plan accept lookahead`: the target's own greedy outputs on a dataset, for offline trie replay."""

from __future__ import annotations

import time
from collections.abc import Callable

from specplan.core import progress
from specplan.core.acceptance_schema import LookaheadAcceptance, LookaheadRecord
from specplan.core.errors import UserError
from specplan.core.fileio import write_yaml
from specplan.core.models import LoadedModel, tokenizer_fingerprint
from specplan.core.plan_schema import load_decoding_plan
from specplan.core.prompts import encode_prompt, uses_chat_template
from specplan.core.provenance import provenance
from specplan.decoder.api import load_decoder
from specplan.decoder.sampling import SamplingParams
from specplan.profiler.datasets import read_dataset, spread_sample

# Another engine's greedy decoding of the target (`plan accept lookahead --engine llama.cpp`): given the loaded
# target and the longest context, a function from prompt ids and a token budget to the new tokens, and its name.
EngineOutputs = Callable[[LoadedModel, int], tuple[Callable[[list[int], int], list[int]], str]]


def run_lookahead_acceptance(target_name: str, dataset: str, samples: int | None, max_new_tokens: int, dtype: str,
                             chat: bool, output: str, log: Callable[[str], None] = progress.say,
                             decode_with: str | None = None,
                             engine_outputs: EngineOutputs | None = None) -> LookaheadAcceptance:
    """Greedy outputs of the target alone, or, with `decode_with` (a Lookahead plan), of that plan's decoder, or,
    with `engine_outputs`, of another engine (the text whose prompt lookup that engine's plan replays).

    In fp32 both are the target's greedy outputs. In bf16 a forward of 12 tokens rounds differently from a
    forward of one, so outputs drift apart after a few dozen tokens and a trie replay over the target's own
    outputs predicts another text than speculative decoding emits; outputs decoded with the plan are the ones
    a benchmark of that plan reproduces, prompt for prompt (same prompts, same order, one trie across them)."""
    if max_new_tokens < 1:
        raise UserError(f"the number of new tokens must be >= 1, got {max_new_tokens}")
    prompts = spread_sample(read_dataset(dataset), samples)
    if not prompts:
        raise UserError(f"{dataset}: no prompts")
    if decode_with is not None and engine_outputs is not None:
        raise UserError("--decode-with decodes with our decoder; another engine decodes the target alone")
    if decode_with is not None:
        load_decoding_plan(decode_with, "lookahead", target_name, dtype)
    decoder = load_decoder(decode_with, target=target_name, dtype=dtype, log=log)
    decoder.draft_every_step()  # as the offline replay of these outputs drafts: at every step
    decoder.restart()
    target, engine = decoder.target, decoder.engine
    decoding = "greedy (the target alone)" if decoder.plan is None else \
        f"greedy, decoded with the Lookahead plan {decode_with} (L_d = {decoder.plan.settings.decoding_length}, " \
        f"L_b = {decoder.plan.settings.branch_length})"
    encoded = [encode_prompt(target.tokenizer, prompt.text, chat) for prompt in prompts]
    if engine_outputs is not None:
        generate, name = engine_outputs(target, max(map(len, encoded)) + max_new_tokens)
        decoding = f"greedy, decoded by {name}"
    else:
        def generate(ids: list[int], budget: int) -> list[int]:
            return engine.generate(ids, budget, SamplingParams()).tokens
    start = time.perf_counter()
    records = []
    for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
        records.append(LookaheadRecord(prompt.id, prompt.category, ids, generate(ids, max_new_tokens)))
        log(f"[{index + 1}/{len(prompts)}] {prompt.category} {prompt.id}: {len(ids)} prompt tokens, "
            f"{len(records[-1].output)} generated")
    acceptance = LookaheadAcceptance(
        target=target.name, tokenizer=tokenizer_fingerprint(target.tokenizer), records=records,
        dtype=dtype,
        decoded_with=None if decoder.plan is None else (decoder.plan.settings.decoding_length,
                                                        decoder.plan.settings.branch_length),
        extra={"decoding": decoding,
               "max_new_tokens": max_new_tokens,
               "stop_tokens": sorted(target.stop_token_ids),  # engines' prompt lookup cuts drafts at them
               "dataset": {"spec": dataset, "prompts": len(prompts),
                           "chat_template": uses_chat_template(target.tokenizer, chat),
                           "categories": sorted({p.category for p in prompts})},
               "seconds": round(time.perf_counter() - start, 1), "provenance": provenance()})
    write_yaml(output, acceptance.to_dict())
    return acceptance

