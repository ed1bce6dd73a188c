"""The checks every API request passes before it is parsed: API key, content type, readiness, body size, model.

Each raises an ``APIError`` (answered with the OpenAI envelope). The POST routes take ``application/json`` only
(415 otherwise: a browser form cannot post to them); bodies over ``MAX_BODY_BYTES`` get a 413 after up to
``DRAIN_BODY_BYTES`` have been read and dropped, so that the client sees the answer rather than a reset. A body
must arrive within ``--body-timeout`` of the start of its reading, with no pause between two of its chunks longer
than ``--header-timeout``: else a 408 and the connection is closed (a slow body would hold a connection, and with
``--limit-concurrency`` a few of them would lock every client out). A client that leaves mid-body raises
Starlette's ``ClientDisconnect``, which ``server.errors`` answers as a disconnect.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import TYPE_CHECKING

from fastapi import Request

from server.api_error import APIError, retry_later

if TYPE_CHECKING:
    from dflash_core.loading import LoadedModels
    from server.state import ServerState
    from server.worker import Worker

MAX_BODY_BYTES = 8 * 1024 * 1024
DRAIN_BODY_BYTES = 64 * 1024 * 1024  # beyond the limit, read (and drop) this much so the client sees the 413
_JSON_TYPES = ("application/json",)


def check_auth(request: Request, api_key: str | None) -> None:
    """401 unless the request carries ``Authorization: Bearer <api_key>`` (no check without a key)."""
    if not api_key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(
            401,
            "invalid or missing API key (send 'Authorization: Bearer <key>')",
            type="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def check_admin(request: Request, api_key: str | None) -> None:
    """The admin routes: 403 when the server has no ``--api-key`` (they are off without one), else ``check_auth``."""
    if not api_key:
        raise APIError(403, "the admin API is off: start the server with --api-key to use it",
                       type="permission_error", code="admin_api_disabled")
    check_auth(request, api_key)


async def check_content_type(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (charset, if given, utf-8)."""
    raw = request.headers.get("content-type")
    media, *params = (raw or "").split(";")
    ok = media.strip().lower() in _JSON_TYPES
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            ok = False
    if ok:
        return
    try:
        await read_body(request)  # read (and drop) what was sent, so that the client sees the answer
    except APIError as e:
        if e.status != 413:
            raise  # a body too slow: its 408 closes the connection
    got = f"got {raw!r}" if raw else "none given"
    raise APIError(
        415,
        f"Content-Type must be application/json ({got})",
        param="Content-Type",
        code="unsupported_media_type",
    )


def check_ready(state: ServerState) -> tuple[LoadedModels, Worker]:
    """The models and the worker; 503 (with ``Retry-After``) while loading, after a failed load, or draining."""
    if state.draining:
        raise retry_later(503, "server is shutting down", "shutting_down")
    if state.models is None or state.worker is None or not state.worker.ready:
        message = f"model failed to load: {state.load_error}" if state.load_error else "model is loading"
        raise retry_later(503, message, "model_not_ready")
    return state.models, state.worker


async def read_body(request: Request) -> bytes:
    """The whole body; 413 beyond ``MAX_BODY_BYTES`` (read up to ``DRAIN_BODY_BYTES`` first), 408 (connection
    closed) when it does not arrive in time (``--body-timeout`` in all, the header timeout between two chunks)."""
    declared = request.headers.get("content-length", "")
    too_large = APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
    if declared.isdigit() and int(declared) > DRAIN_BODY_BYTES:
        raise too_large
    settings = request.app.state.dflash.settings
    gap, whole = settings.header_timeout, settings.body_timeout
    loop = asyncio.get_running_loop()
    deadline = loop.time() + whole
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout_at(min(loop.time() + gap, deadline)) as timer:
            async for chunk in request.stream():
                timer.reschedule(min(loop.time() + gap, deadline))
                size += len(chunk)
                if size > DRAIN_BODY_BYTES:
                    raise too_large
                if size <= MAX_BODY_BYTES:
                    chunks.append(chunk)
    except TimeoutError:
        stalled = f"no body bytes for {gap:g} s" if loop.time() < deadline else f"not complete after {whole:g} s"
        raise APIError(408, f"request body too slow ({stalled}, {size} bytes received); send it at once",
                       code="request_timeout", headers={"Connection": "close"}) from None
    if size > MAX_BODY_BYTES:
        raise too_large
    return b"".join(chunks)


def check_model(name: str, served_model_name: str) -> None:
    """404 unless the request names the model this server serves."""
    if name != served_model_name:
        raise APIError(
            404,
            f"the model '{name}' does not exist; this server serves '{served_model_name}'",
            param="model",
            code="model_not_found",
        )
