"""OpenAI-compatible request/response models and the error envelope.

Requests are validated strictly (a string is not a number); every problem becomes a 400 with the
OpenAI error envelope, never FastAPI's 422. Fields of the OpenAI API that we do not implement are
accepted only with their neutral value (e.g. ``presence_penalty: 0``); anything else names the field
in a 400. Unknown fields are rejected the same way.

Extensions (vLLM-style, outside the OpenAI schema): ``top_k``, ``ignore_eos``, ``stop_token_ids`` and, for
chat, ``chat_template_kwargs`` in requests; in responses, and in the final usage chunk of a stream, a
``dflash`` object with the speculative summary summed over choices: ``num_drafts`` (verify steps with a
draft), ``num_draft_tokens``, ``num_accepted_tokens`` and ``mean_acceptance_length`` (1 + accepted / drafts).
"""

from __future__ import annotations

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
    "presence_penalty": _neutral(0),
    "frequency_penalty": _neutral(0),
    "repetition_penalty": _neutral(1),
    "logit_bias": _neutral({}),
    "min_p": _neutral(0),
    "min_tokens": _neutral(0),
    "best_of": _neutral(1),
    "use_beam_search": _neutral(False),
    "length_penalty": _neutral(1),
    "guided_json": _neutral(),
    "guided_regex": _neutral(),
    "guided_choice": _neutral(),
    "guided_grammar": _neutral(),
    "prompt_logprobs": _neutral(),
    "service_tier": _neutral("auto", "default"),
    "store": _neutral(False),
    "metadata": _neutral({}),
}

_CHAT_UNSUPPORTED: dict[str, Any] = {
    **_COMMON_UNSUPPORTED,
    "tools": _neutral([]),
    "tool_choice": _neutral("none"),
    "functions": _neutral([]),
    "function_call": _neutral("none"),
    "parallel_tool_calls": lambda v: v is None or isinstance(v, bool),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "audio": _neutral(),
    "modalities": _neutral(["text"]),
    "prediction": _neutral(),
    "reasoning_effort": _neutral(),
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


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(v, str):
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

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)


class _SamplingFields(_Strict):
    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any, info: ValidationInfo) -> Any:
        _check_message_count(data, (info.context or {}).get("max_model_len"))
        return _drop_neutral(data, _CHAT_UNSUPPORTED)

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

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
    return APIError(400, msg, param=param)


def _is_union_tag(x: Any) -> bool:
    return isinstance(x, str) and ("[" in x or x in {"str", "int", "float", "bool", "list", "dict"})


REQUEST_MODELS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "chat": ChatCompletionRequest,
    "completion": CompletionRequest,
}


def parse_request(
    kind: str, body: bytes, max_model_len: int | None = None
) -> ChatCompletionRequest | CompletionRequest:
    """Parse and validate a JSON body (``kind``: "chat" or "completion"); APIError 400 on any problem.

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
