"""Long-context prompts: essays concatenated to a requested token length, a planted needle sentence, then a
question about the needle or a summarization request. The essays are any dataset `--dataset` takes: a folder of .txt
files (the carried `haystack` set by its short name), or a JSONL file whose records' texts stand as the essays
(`specbench:summarization,rag`: news articles and retrieved passages instead of Paul Graham's essays)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specplan.core.errors import UserError
from specplan.core.prompts import encode_prompt
from specplan.profiler.datasets import read_dataset, spread_sample

NEEDLES = [
    ("The secret ingredient in Grandma Ola's lemon cake is a spoonful of cardamom.",
     "What is the secret ingredient in Grandma Ola's lemon cake?"),
    ("The access code for the north warehouse is 7-4-1-9-3.",
     "What is the access code for the north warehouse?"),
    ("Captain Mirela Stone sailed the research ship Halcyon to the Weddell Sea in 1987.",
     "Which ship did Captain Mirela Stone sail, and where did she take it?"),
    ("The best place to watch the meteor shower in Verdun Valley is the old fire tower on Ash Hill.",
     "Where is the best place to watch the meteor shower in Verdun Valley?"),
]
KINDS = ("needle", "summary")


@dataclass(frozen=True)
class LongPrompt:
    id: str
    category: str
    ids: list[int]
    needle: str | None
    context: int  # the requested length (the prompt holds it within about 1%)


def essays(dataset: str | Path) -> list[str]:
    return [re.sub(r"\n{3,}", "\n\n", prompt.text).strip() for prompt in read_dataset(str(dataset))]


def build_prompts(dataset: str | Path, tokenizer: Any, context_tokens: int, count: int, chat: bool = True,
                  kinds: tuple[str, ...] = KINDS, seed: int = 0, one_document: bool = False) -> list[LongPrompt]:
    """`count` prompts of about `context_tokens` tokens each (within 1%), alternating the kinds. `one_document`: every
    prompt asks about the same document (the essays in one order, every needle planted), as clients asking questions
    of one long text do; they differ in their last line only."""
    if context_tokens < 256:
        raise UserError(f"long prompts need at least 256 tokens, got {context_tokens}")
    texts = essays(dataset)
    rng = random.Random(seed)
    if one_document:
        return _about_one_document(dataset, texts, tokenizer, context_tokens, count, chat, kinds, rng)
    prompts = []
    for index in range(count):
        kind = kinds[index % len(kinds)]
        needle, question = NEEDLES[index % len(NEEDLES)]
        order = texts[:]
        rng.shuffle(order)
        request = _request(kind, question)
        overhead = len(encode_prompt(tokenizer, "Read these essays." + request, chat))
        budget = context_tokens - overhead - (len(tokenizer(needle)["input_ids"]) if kind == "needle" else 0)
        document = _document(dataset, order, tokenizer, budget)
        if kind == "needle":
            document = _planted(document, needle, rng.uniform(0.2, 0.8))
        ids = encode_prompt(tokenizer, "Read these essays.\n\n" + document + request, chat)
        prompts.append(LongPrompt(f"{kind}-{context_tokens}-{index}", kind, ids,
                                  needle if kind == "needle" else None, context_tokens))
    return prompts


def _about_one_document(dataset: str | Path, texts: list[str], tokenizer: Any, context_tokens: int, count: int,
                        chat: bool, kinds: tuple[str, ...], rng: random.Random) -> list[LongPrompt]:
    order = texts[:]
    rng.shuffle(order)
    requests = [_request(kind, question) for kind in kinds for _, question in NEEDLES]
    overhead = max(len(encode_prompt(tokenizer, "Read these essays." + request, chat)) for request in requests)
    planted = sum(len(tokenizer(needle)["input_ids"]) for needle, _ in NEEDLES) if "needle" in kinds else 0
    document = _document(dataset, order, tokenizer, context_tokens - overhead - planted)
    if "needle" in kinds:
        for place, (needle, _) in enumerate(NEEDLES):
            document = _planted(document, needle, (place + 1) / (len(NEEDLES) + 1))
    prompts = []
    for index in range(count):
        kind = kinds[index % len(kinds)]
        needle, question = NEEDLES[index // len(kinds) % len(NEEDLES)]
        ids = encode_prompt(tokenizer, "Read these essays.\n\n" + document + _request(kind, question), chat)
        prompts.append(LongPrompt(f"{kind}-{context_tokens}-{index}", kind, ids,
                                  needle if kind == "needle" else None, context_tokens))
    return prompts


def _request(kind: str, question: str) -> str:
    return (f"\n\nAnswer briefly: {question}" if kind == "needle"
            else "\n\nSummarize the essays above in a few paragraphs.")


def _document(dataset: str | Path, order: list[str], tokenizer: Any, budget: int) -> str:
    """The essays in `order`, cut to `budget` tokens."""
    if budget < 1:
        raise UserError(f"the prompt's request lines and needles take {-budget} tokens more than its context: use "
                        "a longer context")
    body: list[int] = []
    for text in order:
        body.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if len(body) >= budget:
            break
    if len(body) < budget:
        raise UserError(f"{dataset}: the essays hold fewer than {budget} tokens")
    return tokenizer.decode(body[:budget])


def _planted(document: str, needle: str, fraction: float) -> str:
    """`needle` after the last sentence ending before `fraction` of the document."""
    cut = document.rfind(". ", 0, int(len(document) * fraction)) + 2
    return document[:cut] + needle + " " + document[cut:]


def served_prompts(dataset: str | Path, tokenizer: Any, count: int, chat: bool = True, context: int | None = None,
                   one_document: bool = False) -> list[list[int]]:
    """The token ids a serving benchmark sends: `count` prompts of `dataset` spread over its categories, or with
    `context`, long prompts of that many tokens built from its texts (build_prompts)."""
    if context is not None:
        return [p.ids for p in build_prompts(dataset, tokenizer, context, count, chat, one_document=one_document)]
    return [encode_prompt(tokenizer, p.text, chat) for p in spread_sample(read_dataset(dataset), count)]
