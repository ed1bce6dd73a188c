"""The fields chat and completion requests share (``SamplingFields``): model, sampling controls, stops, n, stream.

Implemented beyond the basics: ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``
with string token-id keys, ``min_p``, ``min_tokens``; vLLM-style extensions ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``. Fields that cannot change the output
(``prompt_cache_key``, ``safety_identifier``, ``metadata``, ``stream_options.include_obfuscation``) are
accepted and ignored; ``store: false`` keeps the request out of
``--record-traffic``. A field given as null takes its default, as OpenAI and vLLM read it (``null_means_default``:
``"stream": null`` is ``false``, ``"n": null`` is 1); a wrong type is still refused.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from server.field_policy import Strict, null_means_default

MAX_N = 8
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16

_ASCII_TOKEN_ID = re.compile(r"\s*[0-9]+\s*", re.ASCII)  # a logit_bias key: ASCII digits, as int() reads them


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted, ignored (no obfuscation padding is sent)
    continuous_usage_stats: bool | None = None  # with include_usage: usage on every chunk too (vLLM's)


class SamplingFields(Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)  # each request kind sets its own default
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias in [-100, 100]
    min_tokens: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted and ignored: they cannot change the output
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # false: never recorded by --record-traffic (server/traffic.py)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return null_means_default(data, cls)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if any(t < 0 for t in v or []):
            raise ValueError("token ids must be non-negative integers")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not _ASCII_TOKEN_ID.fullmatch(key):  # not str.isdigit: "²" is a digit there, and int() refuses it
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @model_validator(mode="after")
    def _fields_agree(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        limit = self.requested_max_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: must be at most the request's max_tokens ({self.min_tokens} > {limit})")
        return self

    def requested_max_tokens(self) -> int | None:
        """The request's own limit on completion tokens (None: the context and the model's defaults decide)."""
        return self.max_tokens

    def stop_list(self) -> list[str]:
        """Stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats`` with ``include_usage``: usage on every chunk."""
        return self.include_usage() and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def include_usage(self) -> bool:
        """Whether a final usage chunk is asked for."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_biases(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
