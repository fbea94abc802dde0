"""A prompt's token ids, with or without the model's chat template: one encoding for acceptance, profiling,
decoding and the benchmarks."""

from __future__ import annotations

from core.errors import UserError


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("the model's tokenizer has no chat template: encode the prompt as given, without one")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
