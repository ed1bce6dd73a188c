"""Errors as OpenAI envelopes: the app's exception handlers, the 500 middleware, worker failures.

Every error a client sees is ``{"error": {"message", "type", "param", "code"}}``. Internal errors (500) carry a
generic message with the request id; the details go to the log, once, with that id. A client that leaves while
its body is being read (Starlette's ``ClientDisconnect``) is a disconnect like any other: one info line, no traceback.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from server.api_error import APIError, error_body
from server.protocol import new_id

if TYPE_CHECKING:
    from server.handoff import WorkerEvent

log = logging.getLogger("dflash.server")

CLIENT_GONE = APIError(499, "client disconnected", code="client_closed_request")


def error_response(e: APIError) -> JSONResponse:
    """The JSON response of ``e`` (status, envelope, headers such as ``Retry-After``)."""
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer APIError, HTTP errors (404, 405, ...) and validation errors with the envelope, a client gone mid-body
    with one log line; 500s via ``InternalErrors``."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(e.detail), kind), status_code=e.status_code, headers=getattr(e, "headers", None)
        )

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, e: ClientDisconnect) -> JSONResponse:
        log.info("request %s: client disconnected during %s %s", request_id(request), request.method,
                 request.url.path)
        return error_response(CLIENT_GONE)  # nobody reads it: uvicorn drops what is sent after a disconnect

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "invalid_request_error"), status_code=400)

    # Not an ``Exception`` handler: Starlette's ServerErrorMiddleware re-raises after calling it, and uvicorn
    # would log the error a second time, without the request id.
    app.add_middleware(InternalErrors)


class InternalErrors:
    """ASGI middleware: an unhandled exception is logged once, with the request id, and answered with a 500."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            if started:  # too late for a 500: uvicorn closes the connection (and logs it)
                raise
            request = Request(scope)
            rid = request_id(request)
            log.error("request %s: unhandled error on %s %s", rid, request.method, request.url.path, exc_info=e)
            await error_response(internal_error(rid))(scope, receive, send)


def request_id(request: Request) -> str:
    """The id of this request in logs and 500 messages (the response id once a route has made one)."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = request.state.request_id = new_id("req")
    return rid


def internal_error(rid: str) -> APIError:
    """The 500 a client sees: no internal detail, the request id to find it in the log."""
    return APIError(
        500,
        f"internal server error (request id {rid})",
        type="server_error",
        headers={"X-Request-Id": rid},
    )


def event_error(ev: WorkerEvent, rid: str) -> APIError:
    """The APIError of a failed request (a 500's detail goes to the log, not to the client)."""
    assert ev.error is not None
    if ev.error.status == 500:
        log.error("request %s failed: %s", rid, ev.error.message)
        return internal_error(rid)
    return APIError(ev.error.status, ev.error.message, type=ev.error.type)
