"""The field policy of request bodies: strict types, unknown fields refused, unimplemented fields only neutral.

Requests are validated strictly (a string is not a number) and a field we do not know is refused (``Strict``).
Fields of the OpenAI API that we do not implement are accepted only with their neutral value (e.g. ``best_of: 1``)
and then dropped (``drop_neutral``); anything else names the field in a 400. A field given as null takes its
default, as OpenAI and vLLM read it (``null_means_default``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A request model: strict types, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _neutral(*values: Any) -> Any:
    """A check that accepts None or one of ``values`` (numbers compare by value, booleans by identity)."""

    def check(v: Any) -> bool:
        if v is None:
            return True
        for x in values:
            if isinstance(x, bool) or isinstance(v, bool):
                if v is x:
                    return True
            elif v == x:
                return True
        return False

    return check


_COMMON_UNSUPPORTED: dict[str, Any] = {
    "best_of": _neutral(1),
    "use_beam_search": _neutral(False),
    "length_penalty": _neutral(1),
    "guided_json": _neutral(),
    "guided_regex": _neutral(),
    "guided_choice": _neutral(),
    "guided_grammar": _neutral(),
    "prompt_logprobs": _neutral(),
    "service_tier": _neutral("auto", "default"),
}

CHAT_UNSUPPORTED: dict[str, Any] = {
    **_COMMON_UNSUPPORTED,
    "functions": _neutral([]),
    "function_call": _neutral("none"),
    "audio": _neutral(),
    "modalities": _neutral(["text"]),
    "prediction": _neutral(),
    "web_search_options": _neutral(),
    "verbosity": _neutral(),
}

COMPLETION_UNSUPPORTED: dict[str, Any] = {
    **_COMMON_UNSUPPORTED,
    "echo": _neutral(False),
    "suffix": _neutral(""),
}


def drop_neutral(data: Any, table: dict[str, Any]) -> Any:
    """Remove neutral unsupported fields; raise a ValueError naming a non-neutral one."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for name, is_neutral in table.items():
        if name in out:
            if not is_neutral(out[name]):
                raise ValueError(f"unsupported field '{name}': this server does not implement it")
            del out[name]
    return out


def null_means_default(data: Any, model: type[BaseModel]) -> Any:
    """``data`` without the fields given as null whose default is not null: such a null means the default (required
    fields stay, to be refused)."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    nulls = [k for k, v in data.items() if v is None and k in fields and not fields[k].is_required()
             and fields[k].default is not None]
    return {k: v for k, v in data.items() if k not in nulls} if nulls else data
