"""A prompt's token ids, with or without the model's chat template: one encoding for acceptance, profiling,
decoding and the benchmarks."""

from __future__ import annotations

from specplan.core import progress

_said_no_template: set[str] = set()  # the tokenizers whose missing chat template was already announced


def uses_chat_template(tokenizer, chat: bool) -> bool:
    """Whether prompts asked for with `chat` get the chat template: a model without one (a base model) takes them as
    given, and says so once."""
    if not chat:
        return False
    if getattr(tokenizer, "chat_template", None):
        return True
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if name not in _said_no_template:
        _said_no_template.add(name)
        progress.say("note: the model has no chat template: prompts are encoded as given")
    return False


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if uses_chat_template(tokenizer, chat):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
