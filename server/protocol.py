"""OpenAI-compatible request/response models and the error envelope.

Requests are validated strictly (a string is not a number); every problem becomes a 400 with the
OpenAI error envelope, never FastAPI's 422. Fields of the OpenAI API that we do not implement are
accepted only with their neutral value (e.g. ``best_of: 1``); anything else names the field in a 400.
Fields that cannot change the output (``prompt_cache_key``, ``safety_identifier``, ``metadata``, ``store``,
``stream_options.include_obfuscation`` / ``continuous_usage_stats``) are accepted and ignored. Unknown fields
are rejected with a 400 naming them.

Implemented beyond the basics: sampling controls (``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias`` with string token-id keys, ``min_p``, ``min_tokens``), and for chat
``tools`` / ``tool_choice`` / ``parallel_tool_calls``, ``tool`` messages and assistant ``tool_calls``,
``response_format`` (``text``, ``json_object``, ``json_schema``), ``reasoning_effort``.

Extensions (vLLM-style, outside the OpenAI schema): ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``repetition_penalty``, ``min_p``, ``min_tokens``, ``skip_special_tokens``, ``include_stop_str_in_output`` and, for
chat, ``chat_template_kwargs``, ``chat_template``, ``add_generation_prompt``, ``continue_final_message`` in
requests; in responses, and in the final usage chunk of a stream, a ``dflash`` object with the speculative summary
summed over choices: ``num_drafts`` (verify steps with a draft), ``num_draft_tokens``, ``num_accepted_tokens`` and
``mean_acceptance_length`` (1 + accepted / drafts). ``/tokenize`` and ``/detokenize`` take vLLM's shapes.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_N = 8
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64
MAX_MESSAGES = 4096  # each message renders to at least one token: more cannot fit any context we serve
MAX_CONTENT_PARTS = 4096  # text parts over all messages (an empty part renders to nothing, so a fixed cap)


_ASCII_TOKEN_ID = re.compile(r"\s*[0-9]+\s*", re.ASCII)  # a logit_bias key: ASCII digits, as int() reads them


class APIError(Exception):
    """An error answered with the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}``."""
        return error_body(self.message, self.type, self.param, self.code)

    def __reduce__(self) -> tuple[Any, ...]:
        """Picklable (a parse helper process sends it back to the server)."""
        return (_rebuild_api_error, (self.status, self.message, self.type, self.param, self.code, self.headers))


def _rebuild_api_error(
    status: int, message: str, type: str, param: str | None, code: str | None, headers: dict[str, str]
) -> APIError:
    return APIError(status, message, type=type, param=param, code=code, headers=headers)


RETRY_AFTER_S = 1  # the Retry-After of every 429 / 503 of the server
_RETRY_TYPES = {429: "rate_limit_error", 503: "service_unavailable"}


def retry_later(status: int, message: str, code: str) -> APIError:
    """A 429 or 503 the client should retry: OpenAI's error type for the status, and ``Retry-After``."""
    return APIError(
        status, message, type=_RETRY_TYPES[status], code=code, headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- fields we do not implement: accepted only with a neutral value -------------------------------------


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

_CHAT_UNSUPPORTED: dict[str, Any] = {
    **_COMMON_UNSUPPORTED,
    "functions": _neutral([]),
    "function_call": _neutral("none"),
    "audio": _neutral(),
    "modalities": _neutral(["text"]),
    "prediction": _neutral(),
    "web_search_options": _neutral(),
    "verbosity": _neutral(),
}

_COMPLETION_UNSUPPORTED: dict[str, Any] = {
    **_COMMON_UNSUPPORTED,
    "echo": _neutral(False),
    "suffix": _neutral(""),
}


def _drop_neutral(data: Any, table: dict[str, Any]) -> Any:
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


# --- request models -------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted, ignored (no obfuscation padding is sent)
    continuous_usage_stats: bool | None = None  # accepted, ignored (usage comes in the final chunk)


# --- chat messages and tools ----------------------------------------------------------------------------


class ToolCallFunction(_Strict):
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it


class ToolCallItem(_Strict):
    """An assistant message's tool call (as the API returned it)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
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


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (None: no arguments)
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: response_format type 'json_schema' needs a 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema: not allowed with response_format type '{self.type}'")
        return self


# --- requests -------------------------------------------------------------------------------------------


class _SamplingFields(_Strict):
    model: str
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
    store: bool | None = None

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
    def _stream_options(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        """Stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        """Whether a final usage chunk is asked for."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_biases(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
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
        _check_message_count(data, (info.context or {}).get("max_model_len"))
        return _drop_neutral(data, _CHAT_UNSUPPORTED)

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt to be false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be an assistant message")
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


def _check_message_count(data: Any, max_model_len: int | None) -> None:
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


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _drop_neutral(data, _COMPLETION_UNSUPPORTED)

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


class TokenizeRequest(_Strict):
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
        _check_message_count(data, (info.context or {}).get("max_model_len"))
        return data

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt to be false")
        return self


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]


def validation_error_to_api(e: ValidationError) -> APIError:
    """Turn a pydantic error into a 400 naming the first offending field."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {err['msg']}")
    loc = [str(x) for x in err["loc"] if not _is_union_tag(x)]
    param = ".".join(loc) or None
    msg = err["msg"]
    msg = msg.removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = f"unrecognized request field '{loc[-1]}'"
    elif err["type"] == "missing":
        msg = f"missing required field '{param}'"
    elif param and not msg.startswith("unsupported field"):
        msg = f"{param}: {msg}"
    if msg.startswith("unsupported field '"):
        param = msg.split("'")[1]
    head, sep, _ = str(err["msg"]).removeprefix("Value error, ").partition(": ")
    if sep and err["type"] == "value_error" and head.isidentifier():
        param = f"{param}.{head}" if param else head  # a check over several fields names its field first
    return APIError(400, msg, param=param)


def _is_union_tag(x: Any) -> bool:
    return isinstance(x, str) and ("[" in x or x in {"str", "int", "float", "bool", "list", "dict"})


AnyRequest = ChatCompletionRequest | CompletionRequest | TokenizeRequest | DetokenizeRequest
REQUEST_MODELS: dict[str, type[AnyRequest]] = {
    "chat": ChatCompletionRequest,
    "completion": CompletionRequest,
    "tokenize": TokenizeRequest,
    "detokenize": DetokenizeRequest,
}


def parse_request(kind: str, body: bytes, max_model_len: int | None = None) -> AnyRequest:
    """Parse and validate a JSON body (``kind``: a key of ``REQUEST_MODELS``); APIError 400 on any problem.

    With ``max_model_len``, token-id prompts and message lists that cannot fit the context are refused here as
    well, so that a parse helper process never sends millions of objects back only for them to be refused.
    """
    if not body.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        req = REQUEST_MODELS[kind].model_validate_json(body, context={"max_model_len": max_model_len})
    except ValidationError as e:
        raise validation_error_to_api(e) from None
    if max_model_len is not None and isinstance(req, CompletionRequest):
        for p in req.prompts():
            if not isinstance(p, str):
                resolve_max_tokens(req.max_tokens, len(p), max_model_len, "prompt")
    return req


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, prompt_param: str) -> int:
    """The completion budget of a prompt of ``prompt_len`` tokens (400 ``context_length_exceeded`` if none)."""
    if prompt_len == 0:
        raise APIError(400, "the prompt is empty", param=prompt_param)
    if requested is None:
        if prompt_len >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt is {prompt_len} tokens, leaving no room for a completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
            f"for the completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def check_min_prompt_tokens(
    min_tokens: int, chars: int, requested: int | None, max_model_len: int, prompt_param: str
) -> None:
    """Refuse, before tokenizing, a prompt of at least ``min_tokens`` tokens that cannot fit the context.

    The same rule as ``resolve_max_tokens``, applied to a lower bound of the prompt's length.
    """
    fits = min_tokens < max_model_len if requested is None else min_tokens + requested <= max_model_len
    if fits:
        return
    raise APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt has {chars} "
        f"characters, which is at least {min_tokens} tokens"
        + (f", plus {requested} for the completion" if requested is not None else "")
        + ". Please reduce the prompt"
        + (" or max_tokens." if requested is not None else "."),
        param=prompt_param,
        code="context_length_exceeded",
    )


def request_schemas() -> dict[str, Any]:
    """JSON schemas of the request bodies (and the models they use) for the OpenAPI ``components``."""
    out: dict[str, Any] = {}
    for model in REQUEST_MODELS.values():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def body_schema(model: str) -> dict[str, Any]:
    """A route's ``openapi_extra`` for a JSON body of the request model named ``model``."""
    ref = {"$ref": f"#/components/schemas/{model}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


# --- responses ------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    """``chatcmpl-<hex>`` / ``cmpl-<hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_ts() -> int:
    """The ``created`` timestamp."""
    return int(time.time())


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI usage block."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
