"""The bodies of ``POST /tokenize`` (``TokenizeRequest``) and ``POST /detokenize`` (``DetokenizeRequest``),
in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationInfo, model_validator

from server.chat_request import ChatMessage, Tool, check_continuation, check_message_count
from server.field_policy import Strict, null_means_default


class TokenizeRequest(Strict):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or ``messages`` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None

    @model_validator(mode="before")
    @classmethod
    def _count(cls, data: Any, info: ValidationInfo) -> Any:
        check_message_count(data, (info.context or {}).get("max_model_len"))
        return null_means_default(data, cls)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        check_continuation(self.messages or [], self.add_generation_prompt, self.continue_final_message)
        return self


class DetokenizeRequest(Strict):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]
