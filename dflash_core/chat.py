"""Conversations to token ids, and the ids that end a generation: one policy for the server, bench, train and `LLM`.

A tokenizer without a chat template is refused (`NoChatTemplateError`) everywhere: guessing a format ("role:
content" lines, joined contents) would produce prompts the model was never trained on and speedups or drafts that
do not transfer to real use. Raw text prompts (`/v1/completions`, `LLM.generate("text")`) need no template.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, Any]


class NoChatTemplateError(ValueError):
    """The tokenizer has no chat template, so a conversation cannot be rendered."""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(
    tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True, **template_kwargs: Any
) -> str:
    """The chat template's text for `messages` (with the assistant's generation prompt by default)."""
    if not has_chat_template(tokenizer):
        raise NoChatTemplateError(
            "the tokenizer has no chat template: give raw text prompts, or use a tokenizer that has one"
        )
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of raw text (a completion prompt: the tokenizer's BOS rules apply)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]


def encode_chat(
    tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True, **template_kwargs: Any
) -> list[int]:
    """Token ids of a conversation, as `apply_chat_template(tokenize=True)` gives them (the template carries
    its own BOS, so the tokenizer adds none)."""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
    return encode_text(tokenizer, text, add_special_tokens=False)


def as_token_ids(value: Any) -> list[int]:
    """A list of ints from a token-id list, a 1-row tensor/array, or a tokenizer's `BatchEncoding` / dict with
    `input_ids` (what `apply_chat_template(tokenize=True)` returns on transformers 5)."""
    if isinstance(value, Mapping) or (hasattr(value, "keys") and "input_ids" in value.keys()):
        value = value["input_ids"]
    if hasattr(value, "tolist"):
        value = value.tolist()
    value = list(value)
    if len(value) == 1 and isinstance(value[0], (list, tuple)):  # one row of a batch
        value = list(value[0])
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in value):
        raise TypeError("token ids must be integers")
    return [operator.index(t) for t in value]


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Ids that end a generation: the model's `generation_config.eos_token_id` (one or a list) and the
    tokenizer's EOS."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)
