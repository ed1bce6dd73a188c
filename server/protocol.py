"""The OpenAI-compatible API's request kinds: ``parse_request`` (a JSON body to a validated request, every
problem a 400 with the OpenAI error envelope, never FastAPI's 422), their OpenAPI schemas, and the pieces every
response has (id, ``created``, usage).

The request models: ``server.chat_request`` (chat, with tools, tool messages, response_format),
``server.completion_request``, ``server.tokenize_request`` (``/tokenize`` and ``/detokenize`` in vLLM's shapes); the
fields chat and completions share are ``server.sampling_fields``; what is accepted and refused is
``server.field_policy``; errors are ``server.api_error.APIError``.

Extensions (vLLM-style, outside the OpenAI schema): ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``repetition_penalty``, ``min_p``, ``min_tokens``, ``skip_special_tokens``, ``include_stop_str_in_output`` and, for
chat, ``chat_template_kwargs``, ``chat_template``, ``add_generation_prompt``, ``continue_final_message`` in
requests; in responses, and in the final usage chunk of a stream, a ``dflash`` object with the speculative summary
summed over choices: ``num_drafts`` (verify steps with a draft), ``num_draft_tokens``, ``num_accepted_tokens`` and
``mean_acceptance_length`` (1 + accepted / drafts).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import ValidationError

from server.admin_request import AdminDraftRequest
from server.api_error import APIError
from server.chat_request import ChatCompletionRequest
from server.completion_request import CompletionRequest
from server.context_length import resolve_max_tokens
from server.tokenize_request import DetokenizeRequest, TokenizeRequest


def validation_error_to_api(e: ValidationError) -> APIError:
    """Turn a pydantic error into a 400 naming the first offending field."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        msg = str(err["msg"])
        if "surrogate in hex escape" in msg or "end of hex escape" in msg:  # jiter's words for a lone surrogate
            where = msg.rpartition(" at ")[2]
            msg = f"a lone surrogate (a \\uD800-\\uDFFF escape without its pair) is not valid JSON text, at {where}"
        return APIError(400, f"malformed JSON body: {msg}")
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


AnyRequest = ChatCompletionRequest | CompletionRequest | TokenizeRequest | DetokenizeRequest | AdminDraftRequest
REQUEST_MODELS: dict[str, type[AnyRequest]] = {
    "chat": ChatCompletionRequest,
    "completion": CompletionRequest,
    "tokenize": TokenizeRequest,
    "detokenize": DetokenizeRequest,
    "admin_draft": AdminDraftRequest,
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
