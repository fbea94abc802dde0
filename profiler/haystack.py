"""Long-context prompts: essays concatenated to a requested token length, a planted needle sentence, then a
question about the needle or a summarization request. The essays are read from the given folder, or from the
carried `haystack` set by its short name."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specplan.core.errors import UserError
from specplan.core.prompts import encode_prompt
from specplan.profiler.datasets import resolve_dataset

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


def essays(directory: str | Path) -> list[str]:
    folder, category = resolve_dataset(directory)
    if category is not None:
        raise UserError(f"{directory}: a folder of essays has no categories")
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise UserError(f"{directory}: no .txt essays to build long prompts from")
    return [re.sub(r"\n{3,}", "\n\n", f.read_text(errors="replace")).strip() for f in files]


def build_prompts(directory: str | Path, tokenizer: Any, context_tokens: int, count: int, chat: bool = True,
                  kinds: tuple[str, ...] = KINDS, seed: int = 0) -> list[LongPrompt]:
    """`count` prompts of about `context_tokens` tokens each (within 1%), alternating the kinds."""
    if context_tokens < 256:
        raise UserError(f"long prompts need at least 256 tokens, got {context_tokens}")
    texts = essays(directory)
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        kind = kinds[index % len(kinds)]
        needle, question = NEEDLES[index % len(NEEDLES)]
        order = texts[:]
        rng.shuffle(order)
        request = (f"\n\nAnswer briefly: {question}" if kind == "needle"
                   else "\n\nSummarize the essays above in a few paragraphs.")
        overhead = len(encode_prompt(tokenizer, "Read these essays." + request, chat))
        budget = context_tokens - overhead - (len(tokenizer(needle)["input_ids"]) if kind == "needle" else 0)
        body: list[int] = []
        for text in order:
            body.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
            if len(body) >= budget:
                break
        if len(body) < budget:
            raise UserError(f"{directory}: the essays hold fewer than {budget} tokens")
        document = tokenizer.decode(body[:budget])
        if kind == "needle":
            cut = document.rfind(". ", 0, int(len(document) * rng.uniform(0.2, 0.8))) + 2
            document = document[:cut] + needle + " " + document[cut:]
        ids = encode_prompt(tokenizer, "Read these essays.\n\n" + document + request, chat)
        prompts.append(LongPrompt(f"{kind}-{context_tokens}-{index}", kind, ids,
                                  needle if kind == "needle" else None, context_tokens))
    return prompts
