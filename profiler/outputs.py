"""`plan accept lookahead`: the target's own greedy outputs on a dataset, for offline trie replay."""

from __future__ import annotations

import time
from collections.abc import Callable

from decoder.api import stop_token_ids
from decoder.engine import SpeculativeEngine
from decoder.model import LeanModel
from decoder.sampling import SamplingParams
from profiler.datasets import encode_prompt, read_dataset, spread_sample
from specplan.acceptance_schema import LookaheadAcceptance, LookaheadRecord
from specplan.errors import UserError
from specplan.fileio import write_yaml
from specplan.models import load_model, tokenizer_fingerprint
from specplan.provenance import provenance


def run_lookahead_acceptance(target_name: str, dataset: str, samples: int | None, max_new_tokens: int, dtype: str,
                             chat: bool, output: str, log: Callable[[str], None] = print) -> LookaheadAcceptance:
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    prompts = spread_sample(read_dataset(dataset), samples)
    if not prompts:
        raise UserError(f"{dataset}: no prompts")
    target = load_model(target_name, dtype, log=log)
    engine = SpeculativeEngine(LeanModel(target.model), None, stop_token_ids(target))
    start = time.perf_counter()
    records = []
    for index, prompt in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, prompt.text, chat)
        result = engine.generate(ids, max_new_tokens, SamplingParams())
        records.append(LookaheadRecord(prompt.id, prompt.category, ids, result.tokens))
        log(f"[{index + 1}/{len(prompts)}] {prompt.category} {prompt.id}: {len(ids)} prompt tokens, "
            f"{len(result.tokens)} generated")
    acceptance = LookaheadAcceptance(
        target=target_name, tokenizer=tokenizer_fingerprint(target.tokenizer), records=records,
        extra={"dtype": dtype, "decoding": "greedy (the target alone)", "max_new_tokens": max_new_tokens,
               "dataset": {"spec": dataset, "prompts": len(prompts), "chat_template": chat,
                           "categories": sorted({p.category for p in prompts})},
               "seconds": round(time.perf_counter() - start, 1), "provenance": provenance()})
    write_yaml(output, acceptance.to_dict())
    return acceptance
