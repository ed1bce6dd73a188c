"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (tokenized as a completion prompt: special-token text is special,
``add_special_tokens`` defaults to true) or ``messages`` (rendered by the chat template as a chat request's are,
message text kept as plain text; ``add_special_tokens`` defaults to false) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with ``return_token_strs``).
``/detokenize`` takes ``{"tokens"}`` and answers ``{"prompt"}`` (special tokens kept, as vLLM does). Both pass the
checks of the generation routes (API key, content type, readiness, body size, model name when given).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from server import affinity
from server.api_error import APIError
from server.checks import check_auth, check_content_type, check_model, check_ready, read_body
from server.parsing import is_cheap
from server.protocol import body_schema
from server.runs import prepare
from server.tokenize_request import DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from server.state import ServerState


async def _parse(state: ServerState, request: Request, kind: str) -> tuple[Any, bytes]:
    check_auth(request, state.settings.api_key)
    await check_content_type(request)
    models, _ = check_ready(state)
    body = await read_body(request)
    req = await state.parser.parse(kind, body, models.engine.max_model_len)
    if req.model is not None:
        check_model(req.model, state.served_model_name)
    return req, body


def install_tokenize_routes(app: FastAPI, state: ServerState) -> None:
    """Add ``/tokenize`` and ``/detokenize`` to ``app``."""

    @app.post("/tokenize", openapi_extra=body_schema("TokenizeRequest"))
    async def tokenize(request: Request) -> dict[str, Any]:
        req, body = await _parse(state, request, "tokenize")
        assert isinstance(req, TokenizeRequest) and state.prompts is not None and state.models is not None
        prompts = state.prompts
        big = not is_cheap(body)
        if req.messages is not None:
            size = sum(len(m.text()) + 1 for m in req.messages)
            tokens = await prepare(state.tokenize_limiter, size, big, prompts.chat, req)
        else:
            assert req.prompt is not None
            special = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = await prepare(state.tokenize_limiter, len(req.prompt), big, prompts.tokenize_prompt, req.prompt,
                                   special)
        strs = prompts.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": state.models.engine.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    @app.post("/detokenize", openapi_extra=body_schema("DetokenizeRequest"))
    async def detokenize(request: Request) -> dict[str, Any]:
        req, _ = await _parse(state, request, "detokenize")
        assert isinstance(req, DetokenizeRequest) and state.prompts is not None
        vocab = state.prompts.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
        tokenizer = state.prompts.tokenizer
        text = await run_in_threadpool(affinity.unpinned(tokenizer.decode), req.tokens)
        return {"prompt": text}
