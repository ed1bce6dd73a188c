"""Training data: JSONL rows -> `Example`s (prompt ids, and response ids where the data gives them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_core.chat import NoChatTemplateError, encode_chat, encode_text
from dflash_core.jsonl import JSONLError, read_jsonl


class UsageError(Exception):
    """Bad input: reported as one clear message with a non-zero exit status."""


@dataclass
class Example:
    """One training sequence: prompt ids followed by response ids."""

    prompt: list[int]
    response: list[int] | None


def read_rows(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a clear UsageError for missing, unreadable, malformed or empty files."""
    if not path.is_file():
        raise UsageError(f"data file {path} does not exist")
    try:
        rows = read_jsonl(path, limit)
    except JSONLError as exc:
        raise UsageError(str(exc)) from None
    if not rows:
        raise UsageError(f"data file {path} is empty: no prompts to train on")
    return rows


def encode_rows(rows: list[dict[str, Any]], tok: Any, regenerate: bool, max_prompt: int) -> list[Example]:
    """Tokenize prompts (chat template for `messages`) and any given responses (ending in EOS); a recorded request
    (`prompt_token_ids`, `output_token_ids`: `dflash_core.train.traffic`) is taken as its token ids.

    `messages` rows need a tokenizer with a chat template (`dflash_core.chat`'s one policy): without one they
    are refused with a UsageError instead of being rendered in an invented format."""
    out: list[Example] = []
    eos = tok.eos_token_id  # a given response ends in the tokenizer's own EOS, as its chat turns do
    for n, row in enumerate(rows, 1):
        response_text = None
        if "prompt_token_ids" in row:  # a recorded request (`--record-traffic`): the target's own output
            recorded = None if regenerate else list(row.get("output_token_ids") or [])
            out.append(Example(list(row["prompt_token_ids"])[-max_prompt:], recorded))
            continue
        if "messages" in row:
            msgs = row["messages"]
            if not isinstance(msgs, list) or not msgs:
                raise UsageError(f"row {n}: 'messages' must be a non-empty list")
            if msgs[-1].get("role") == "assistant":
                response_text, msgs = msgs[-1].get("content", ""), msgs[:-1]
            if not msgs:
                raise UsageError(f"row {n}: no prompt messages before the assistant reply")
            try:
                prompt = encode_chat(tok, msgs)
            except NoChatTemplateError:
                raise UsageError(
                    f"row {n}: 'messages' rows need a tokenizer with a chat template and this one has none: "
                    "give 'prompt'/'text' rows instead, or pass --tokenizer with a chat template"
                ) from None
        else:
            text = row.get("prompt", row.get("text"))
            if not isinstance(text, str) or not text:
                raise UsageError(f"row {n}: needs 'messages', 'prompt' or 'text'")
            prompt = encode_text(tok, text)
            response_text = row.get("response", row.get("completion"))
        prompt = prompt[-max_prompt:]
        response = None
        if response_text and not regenerate:
            response = encode_text(tok, response_text, add_special_tokens=False)
            if eos is not None:
                response = response + [eos]
        out.append(Example(prompt, response))
    return out
