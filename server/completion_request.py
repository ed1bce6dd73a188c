"""The completion request (``CompletionRequest``): a prompt as text or token ids, or a batch of them."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from server.field_policy import COMPLETION_UNSUPPORTED, drop_neutral
from server.sampling_fields import MAX_TOP_LOGPROBS, SamplingFields

MAX_PROMPTS = 64


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return drop_neutral(data, COMPLETION_UNSUPPORTED)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if len(v) > MAX_PROMPTS and not isinstance(v[0], int):
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if any(isinstance(p, (str, list)) and len(p) == 0 for p in v):
                raise ValueError("prompt must not be empty")
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request (one per batch entry)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
