"""The chat completion request (``ChatCompletionRequest``): messages, tools and tool choice, response_format.

Implemented: ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, ``tool`` messages and assistant ``tool_calls``,
``response_format`` (``text``, ``json_object``, ``json_schema``), ``reasoning_effort``, text content parts; vLLM-style
extensions ``chat_template_kwargs``, ``chat_template``, ``add_generation_prompt``, ``continue_final_message``.
``check_message_count`` refuses, before validation, more messages or content parts than can fit;
``check_continuation`` is the rule of ``continue_final_message`` (``/tokenize`` applies it too).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from server.api_error import APIError
from server.field_policy import CHAT_UNSUPPORTED, Strict, drop_neutral
from server.sampling_fields import MAX_TOP_LOGPROBS, SamplingFields

MAX_MESSAGES = 4096  # each message renders to at least one token: more cannot fit any context we serve
MAX_CONTENT_PARTS = 4096  # text parts over all messages (an empty part renders to nothing, so a fixed cap)


class ToolCallFunction(Strict):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it


class ToolCallItem(Strict):
    """An assistant message's tool call (as the API returned it)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant: earlier reasoning, echoed back by some clients
    reasoning: str | None = None  # the same, under vLLM's newer name

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        if v is None or isinstance(v, str):
            return v
        for part in v:
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported (only 'text')")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")  # noqa: TRY004 (pydantic)
            extra = set(part) - {"type", "text"}
            if extra:
                raise ValueError(f"unsupported content part field(s): {', '.join(sorted(extra))}")
        return v

    @model_validator(mode="after")
    def _fields_of_role(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content: a {self.role} message needs content (null only beside assistant tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only tool messages carry a tool_call_id")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined; "" for null content)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)

    def reasoning_text(self) -> str | None:
        """Earlier reasoning of an assistant message, under either name."""
        return self.reasoning_content if self.reasoning_content is not None else self.reasoning


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (None: no arguments)
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: response_format type 'json_schema' needs a 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema: not allowed with response_format type '{self.type}'")
        return self


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any, info: ValidationInfo) -> Any:
        check_message_count(data, (info.context or {}).get("max_model_len"))
        return drop_neutral(data, CHAT_UNSUPPORTED)

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        check_continuation(self.messages, self.add_generation_prompt, self.continue_final_message)
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools (it names a tool or asks for one)")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names():
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r} in tools")
        if self.tools and len(set(self.tool_names())) != len(self.tools):
            raise ValueError("tools: two tools have the same name")
        if self.response_format is not None and self.response_format.type != "text" and self.forced_tool():
            raise ValueError("response_format: cannot be combined with a required or named tool_choice")
        return self

    def tool_names(self) -> list[str]:
        """The names of the request's tools."""
        return [t.function.name for t in self.tools or []]

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` with OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def forced_tool(self) -> bool:
        """Whether the answer must be a tool call (``required`` or a named tool)."""
        choice = self.effective_tool_choice()
        return choice == "required" or isinstance(choice, NamedToolChoice)

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        """Top alternatives per token, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


def check_continuation(messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool) -> None:
    """``continue_final_message`` leaves the last message open: it needs ``add_generation_prompt`` false and an
    assistant message last (ValueError naming the field otherwise)."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise ValueError("continue_final_message: needs add_generation_prompt to be false")
    if messages and messages[-1].role != "assistant":
        raise ValueError(f"continue_final_message: needs the last message to be an assistant message (it is a "
                         f"{messages[-1].role} message)")


def check_message_count(data: Any, max_model_len: int | None) -> None:
    """Refuse, before validating them one by one, more messages or content parts than can fit (APIError 400)."""
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list):
        return
    limit = MAX_MESSAGES if max_model_len is None else min(MAX_MESSAGES, max_model_len)
    if len(messages) > limit:
        raise APIError(
            400,
            f"{len(messages)} messages cannot fit: each takes at least one token, and at most {limit} are "
            f"accepted (maximum context length {max_model_len or 'unknown'} tokens)",
            param="messages",
            code="context_length_exceeded",
        )
    parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
    if parts > MAX_CONTENT_PARTS:
        raise APIError(400, f"at most {MAX_CONTENT_PARTS} content parts per request (got {parts})", param="messages")
