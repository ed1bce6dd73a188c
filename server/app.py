"""The HTTP face: ``create_app(settings)`` and its routes.

Routes validate and tokenize, hand ``RequestHandle`` objects to the worker thread, and turn the
``WorkerEvent`` objects that come back into OpenAI responses or SSE chunks. Nothing here touches a
tensor; models are loaded in a background thread so that ``/health`` answers 503 meanwhile.

The POST routes take ``application/json`` only (415 otherwise: a browser form cannot post to them). Bodies are
parsed in place when cheap and in a helper process otherwise (``server.parsing``), so that no body stalls the
event loop or the engine; tokenization runs in a thread pool, long texts at most ``TOKENIZE_CONCURRENCY`` at
once, after a cheap check that refuses text that cannot fit the context (``server.prompts``).

Streams send their headers and a ``: ping`` comment at once (after ``STREAM_HEADERS_GRACE_S`` at most, during
which an early failure is still a plain HTTP error), then one ``data:`` event per engine step, a comment every
``sse_ping_interval`` seconds (sent whether or not data flows, so that idle-timeout proxies keep a queued or
prefilling stream), and ``data: [DONE]``. Errors after the headers are an error event followed by ``data: [DONE]``.
A client that stops reading is dropped, and its requests aborted, once a send has waited ``SSE_SEND_TIMEOUT_S``.

Internal errors (500) carry a generic message with the request id; the details go to the log.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import AppStatus, SendTimeoutError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from dflash_core.loading import DEMO_DRAFT, DEMO_TARGET, LoadedModels, load_models
from dflash_core.sampling import SamplingParams
from server import __version__
from server.detokenize import TokenStrings
from server.metrics import ServerMetrics
from server.parsing import Limiter, ParsePool, is_cheap
from server.prompts import PromptBuilder
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now_ts,
    request_schemas,
    resolve_max_tokens,
    retry_later,
    usage_dict,
)
from server.settings import Settings
from server.worker import QueueFullError, RequestHandle, SpecSummary, Worker, WorkerEvent

log = logging.getLogger("dflash.server")

MAX_BODY_BYTES = 8 * 1024 * 1024
DRAIN_BODY_BYTES = 64 * 1024 * 1024  # beyond the limit, read (and drop) this much so the client sees the 413
SSE_SEND_TIMEOUT_S = 60.0  # a stream whose client has not taken a chunk for this long is aborted
STREAM_HEADERS_GRACE_S = 0.1  # a stream waits this long for its first event before it sends its headers
TOKENIZE_LIMIT_CHARS = 32 * 1024  # prompts longer than this take one of TOKENIZE_CONCURRENCY slots
TOKENIZE_CONCURRENCY = max(2, min(8, (os.cpu_count() or 2) // 2))
TOKENIZE_MAX_WAITING = 256  # long prompts waiting for a slot beyond which a 429 answers
_CLIENT_GONE = APIError(499, "client disconnected", code="client_closed_request")
_PING = b": ping\n\n"
_JSON_TYPES = ("application/json",)


@dataclass
class ServerState:
    """What the routes share: settings, the loaded models, the worker, the metrics."""

    settings: Settings
    models: LoadedModels | None = None
    worker: Worker | None = None
    metrics: ServerMetrics | None = None
    token_strings: TokenStrings | None = None
    prompts: PromptBuilder | None = None
    served_model_name: str = ""
    load_error: str | None = None
    parser: ParsePool = field(default_factory=ParsePool)
    tokenize_limiter: Limiter = field(
        default_factory=lambda: Limiter(TOKENIZE_CONCURRENCY, TOKENIZE_MAX_WAITING, "long prompts")
    )
    draining: bool = False  # set on SIGTERM (server.__main__): new requests get 503, /health 503
    created: int = field(default_factory=now_ts)

    @property
    def ready(self) -> bool:
        """Models loaded and the worker running."""
        return self.worker is not None and self.worker.is_alive()

    def install(self, models: LoadedModels) -> None:
        """Start serving ``models``: metrics, worker thread."""
        s = self.settings
        self.served_model_name = s.served_model_name or display_name(models.target_name)
        self.metrics = ServerMetrics(
            block_size=models.block_size,
            target=display_name(models.target_name),
            draft=display_name(models.draft_name),
            device=models.device,
            backend=models.backend,
            max_model_len=models.engine.max_model_len,
        )
        self.token_strings = TokenStrings(models.tokenizer)
        self.prompts = PromptBuilder(
            models.tokenizer, models.engine.max_model_len, allow_special_tokens=s.allow_special_tokens
        )
        worker = Worker(
            models.engine,
            models.tokenizer,
            self.metrics,
            max_running=s.max_running_requests,
            max_waiting=s.max_waiting_requests,
        )
        worker.start()
        self.models = models
        self.worker = worker
        log.info(
            "serving %s as %r (draft %s, block size %d, device %s, dtype %s, max model len %d)",
            models.target_name,
            self.served_model_name,
            models.draft_name or "none (autoregressive)",
            models.block_size,
            models.device,
            models.dtype,
            models.engine.max_model_len,
        )

    def load(self, on_error: Callable[[str], None] | None) -> None:
        """Load the models (background thread), then start serving."""
        s = self.settings
        if s.speculative and s.draft is None and s.target is not None:
            log.warning("no draft model given: serving the target autoregressively")
        try:
            models = load_models(
                target=s.target,
                draft=s.draft if s.speculative else None,
                tokenizer=s.tokenizer,
                device=s.device,
                dtype=s.dtype,
                block_size=s.block_size,
                max_model_len=s.max_model_len,
                speculative=s.speculative,
                backend=s.backend,
                max_running_requests=s.max_running_requests,
            )
            self.install(models)
        except Exception as e:
            self.load_error = " ".join(f"{type(e).__name__}: {e}".split())  # one line
            # one clear line; the traceback only with --log-level debug
            log.error("loading the models failed: %s", self.load_error, exc_info=log.isEnabledFor(logging.DEBUG))
            if on_error is not None:
                on_error(self.load_error)


def display_name(name: str | None) -> str:
    """A model's name for metrics and /v1/models (and the default API name): the folder's name, not its path,
    ``dflash-demo`` for the demo models, or the hub id."""
    if not name:
        return ""
    path = Path(name).expanduser()
    if not path.exists():  # a hub id ("org/name"), or a path that has gone: its last part
        return path.name if name.startswith(("/", ".", "~")) or name.count("/") > 1 else name
    resolved = path.resolve()
    if resolved == DEMO_TARGET.resolve():
        return "dflash-demo"
    if resolved == DEMO_DRAFT.resolve():
        return "dflash-demo-draft"
    return resolved.name


def create_app(
    settings: Settings, models: LoadedModels | None = None, on_load_error: Callable[[str], None] | None = None
) -> FastAPI:
    """The FastAPI app. Without ``models`` they are loaded in a background thread at start-up."""
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if models is not None:
            state.install(models)
        else:
            threading.Thread(
                target=state.load, args=(on_load_error,), name="dflash-load", daemon=True
            ).start()
        yield
        await state.parser.close()
        if state.worker is not None:
            await run_in_threadpool(state.worker.stop)

    # sse-starlette would cancel every stream as soon as uvicorn is asked to exit; server.__main__ drains them.
    if hasattr(AppStatus, "disable_automatic_graceful_drain"):
        AppStatus.disable_automatic_graceful_drain()
    app = FastAPI(title="dflash-serve", version=__version__, lifespan=lifespan)
    app.state.dflash = state
    _install_error_handlers(app)
    _install_routes(app, state)
    _install_openapi(app)
    return app


def _install_openapi(app: FastAPI) -> None:
    """The OpenAPI document with the request body schemas (the routes read their raw bodies themselves)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _body_schema(model: str) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model``."""
    ref = {"$ref": f"#/components/schemas/{model}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


# --- errors -----------------------------------------------------------------------------------------------


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(e.detail), kind), status_code=e.status_code, headers=getattr(e, "headers", None)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "invalid_request_error"), status_code=400)

    # Not an ``Exception`` handler: Starlette's ServerErrorMiddleware re-raises after calling it, and uvicorn
    # would log the error a second time, without the request id.
    app.add_middleware(_InternalErrors)


class _InternalErrors:
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
            rid = _request_id(request)
            log.error("request %s: unhandled error on %s %s", rid, request.method, request.url.path, exc_info=e)
            await _error_response(_internal(rid))(scope, receive, send)


def _request_id(request: Request) -> str:
    """The id of this request in logs and 500 messages (the response id once a route has made one)."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = request.state.request_id = new_id("req")
    return rid


def _internal(rid: str) -> APIError:
    """The 500 a client sees: no internal detail, the request id to find it in the log."""
    return APIError(
        500,
        f"internal server error (request id {rid})",
        type="server_error",
        headers={"X-Request-Id": rid},
    )


def _check_auth(state: ServerState, request: Request) -> None:
    key = state.settings.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            "invalid or missing API key (send 'Authorization: Bearer <key>')",
            type="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def _check_content_type(request: Request) -> None:
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
        await _read_body(request)  # read (and drop) what was sent, so that the client sees the answer
    except APIError:
        pass
    got = f"got {raw!r}" if raw else "none given"
    raise APIError(
        415,
        f"Content-Type must be application/json ({got})",
        param="Content-Type",
        code="unsupported_media_type",
    )


def _check_ready(state: ServerState) -> tuple[LoadedModels, Worker]:
    if state.draining:
        raise retry_later(503, "server is shutting down", "shutting_down")
    if state.models is None or state.worker is None or not state.worker.is_alive():
        message = f"model failed to load: {state.load_error}" if state.load_error else "model is loading"
        raise retry_later(503, message, "model_not_ready")
    return state.models, state.worker


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    too_large = APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="request_too_large")
    if declared.isdigit() and int(declared) > DRAIN_BODY_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > DRAIN_BODY_BYTES:
            raise too_large
        if size <= MAX_BODY_BYTES:
            chunks.append(chunk)
    if size > MAX_BODY_BYTES:
        raise too_large
    return b"".join(chunks)


def _check_model(state: ServerState, name: str) -> None:
    if name != state.served_model_name:
        raise APIError(
            404,
            f"the model '{name}' does not exist; this server serves '{state.served_model_name}'",
            param="model",
            code="model_not_found",
        )


# --- request preparation -----------------------------------------------------------------------------------


async def _prepare(state: ServerState, size: int, big: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """Run tokenization ``fn(*args)`` in the thread pool; a prompt over TOKENIZE_LIMIT_CHARS, or from a ``big``
    body (one that went to a parse helper), takes a slot."""
    if size <= TOKENIZE_LIMIT_CHARS and not big:
        return await run_in_threadpool(fn, *args)
    async with state.tokenize_limiter:
        return await run_in_threadpool(fn, *args)


def _sampling(
    req: ChatCompletionRequest | CompletionRequest, max_tokens: int, logprobs: int | None, i: int
) -> SamplingParams:
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=0 if req.top_k is None else req.top_k,
        seed=None if req.seed is None else req.seed + i,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )
    try:
        params.validate()
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return params


# --- the run of one HTTP request ---------------------------------------------------------------------------


class _Run:
    """The engine requests of one HTTP request: submit, receive events, abort on disconnect."""

    def __init__(
        self,
        worker: Worker,
        request: Request,
        handles: list[RequestHandle],
        queue: asyncio.Queue[WorkerEvent],
    ) -> None:
        self.worker = worker
        self.handles = handles
        self.queue = queue
        self.open = {h.index for h in handles}
        self.pending: list[WorkerEvent] = []
        worker.submit(handles)  # QueueFullError before anything else starts
        self._watch = asyncio.create_task(self._watch_disconnect(request))

    async def _watch_disconnect(self, request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                log.info("client disconnected: aborting %d request(s)", len(self.open))
                self.close()
                return

    async def next(self) -> WorkerEvent:
        """The next event of any of the requests."""
        ev = self.pending.pop(0) if self.pending else await self.queue.get()
        if ev.finish_reason is not None:
            self.open.discard(ev.index)
        return ev

    async def peek(self) -> WorkerEvent:
        """The next event, left in place for ``next``."""
        if not self.pending:
            self.pending.append(await self.queue.get())
        return self.pending[0]

    def close(self) -> None:
        """Abort whatever is unfinished (idempotent)."""
        for h in self.handles:
            if h.index in self.open:
                self.worker.abort(h)
        self.open.clear()
        if self._watch is not asyncio.current_task():
            self._watch.cancel()


def _start_run(
    worker: Worker,
    request: Request,
    rid: str,
    prompts: list[list[int]],
    params: list[list[SamplingParams]],
    stop: list[str],
) -> _Run:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    handles = []
    for pi, (prompt, plist) in enumerate(zip(prompts, params, strict=True)):
        for j, p in enumerate(plist):
            index = pi * len(plist) + j
            handles.append(
                RequestHandle(
                    index=index,
                    prompt_token_ids=prompt,
                    params=p,
                    stop=stop,
                    loop=loop,
                    queue=queue,
                    request_id=f"{rid}-{index}",
                )
            )
    if len(handles) > worker.capacity:
        raise APIError(
            400,
            f"{len(handles)} choices exceed what this server holds at once ({worker.capacity})",
            param="n",
        )
    try:
        return _Run(worker, request, handles, queue)
    except QueueFullError as e:
        raise retry_later(429, f"{e}; retry later", "queue_full") from None


def _event_error(ev: WorkerEvent, rid: str) -> APIError:
    """The APIError of a failed request (a 500's detail goes to the log, not to the client)."""
    assert ev.error is not None
    if ev.error.status == 500:
        log.error("request %s failed: %s", rid, ev.error.message)
        return _internal(rid)
    return APIError(ev.error.status, ev.error.message, type=ev.error.type)


@dataclass
class _Choice:
    """Accumulated output of one choice."""

    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    spec: SpecSummary = field(default_factory=SpecSummary)
    sent_first: bool = False
    text_offset: int = 0


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping", sep="\n")


# --- routes ------------------------------------------------------------------------------------------------


def _install_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if state.ready:
            w = state.worker
            assert w is not None
            return JSONResponse({"status": "ok", "running": w.num_running, "waiting": w.num_waiting})
        if state.load_error:
            return JSONResponse({"status": "error", "message": state.load_error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            _check_ready(state)
        assert state.metrics is not None
        body, content_type = state.metrics.render()
        return Response(body, media_type=None, headers={"Content-Type": content_type})

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        _check_auth(state, request)
        models, _ = _check_ready(state)
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "dflash-serve",
                    "root": display_name(models.target_name),
                    "max_model_len": models.engine.max_model_len,
                    "dflash": {"draft": display_name(models.draft_name) or None, "block_size": models.block_size},
                }
            ],
        }

    @app.post("/v1/chat/completions", openapi_extra=_body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        rid = request.state.request_id = new_id("chatcmpl")
        _check_auth(state, request)
        await _check_content_type(request)
        models, worker = _check_ready(state)
        max_model_len = models.engine.max_model_len
        body = await _read_body(request)
        req = await state.parser.parse("chat", body, max_model_len)
        assert isinstance(req, ChatCompletionRequest) and state.prompts is not None
        _check_model(state, req.model)
        # every message and part costs template work even when empty: they count like characters
        size = sum(len(m.text()) + 1 + (len(m.content) if isinstance(m.content, list) else 0) for m in req.messages)
        prompt = await _prepare(state, size, not is_cheap(body), state.prompts.chat, req)
        max_tokens = resolve_max_tokens(req.requested_max_tokens(), len(prompt), max_model_len, "messages")
        params = [_sampling(req, max_tokens, req.num_logprobs(), i) for i in range(req.n)]
        run = _start_run(worker, request, rid, [prompt], [params], req.stop_list())
        return await _respond(state, run, rid, req, kind="chat", prompt_tokens=len(prompt))

    @app.post("/v1/completions", openapi_extra=_body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        rid = request.state.request_id = new_id("cmpl")
        _check_auth(state, request)
        await _check_content_type(request)
        models, worker = _check_ready(state)
        max_model_len = models.engine.max_model_len
        body = await _read_body(request)
        req = await state.parser.parse("completion", body, max_model_len)
        assert isinstance(req, CompletionRequest) and state.prompts is not None
        _check_model(state, req.model)
        size = sum(len(p) for p in req.prompts() if isinstance(p, str))
        prompts = await _prepare(state, size, not is_cheap(body), state.prompts.completions, req)
        params = []
        for prompt in prompts:
            max_tokens = resolve_max_tokens(req.max_tokens, len(prompt), max_model_len, "prompt")
            params.append([_sampling(req, max_tokens, req.logprobs, i) for i in range(req.n)])
        run = _start_run(worker, request, rid, prompts, params, req.stop_list())
        return await _respond(
            state, run, rid, req, kind="completion", prompt_tokens=sum(len(p) for p in prompts)
        )


async def _first_event(run: _Run, timeout: float | None) -> WorkerEvent | None:
    """The first event, left in place (None when it has not come within ``timeout`` seconds)."""
    try:
        if timeout is None:
            return await run.peek()
        return await asyncio.wait_for(run.peek(), timeout)
    except TimeoutError:
        return None
    except BaseException:
        run.close()
        raise


async def _respond(
    state: ServerState,
    run: _Run,
    rid: str,
    req: ChatCompletionRequest | CompletionRequest,
    kind: str,
    prompt_tokens: int,
) -> Response:
    """Answer or stream; a failure that comes before the response starts is a plain HTTP error."""
    first = await _first_event(run, STREAM_HEADERS_GRACE_S if req.stream else None)
    if first is not None and first.error is not None:
        run.close()
        return _error_response(_event_error(first, rid))
    if first is not None and first.finish_reason == "abort":  # the client left while the request was queued
        run.close()
        return _error_response(_CLIENT_GONE)
    fmt = _Formatter(state, rid, kind, req)
    if req.stream:
        return _event_stream(
            _stream(run, fmt, rid, req.include_usage(), prompt_tokens, announce=first is None),
            state.settings.sse_ping_interval,
            rid,
        )
    choices: dict[int, _Choice] = {h.index: _Choice() for h in run.handles}
    try:
        while run.open:
            ev = await run.next()
            if ev.error is not None:
                return _error_response(_event_error(ev, rid))
            fmt.accumulate(choices[ev.index], ev)
    finally:
        run.close()
    if any(c.finish_reason == "abort" for c in choices.values()):
        return _error_response(_CLIENT_GONE)
    return JSONResponse(fmt.final(choices, prompt_tokens))


class _EventStream(EventSourceResponse):
    """An SSE response that ends quietly (one log line) when its client stops reading."""

    rid = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:  # the body iterator was closed first: its requests are aborted
            log.info("request %s: the client took no data for %.0f s; stream aborted", self.rid, self.send_timeout)


def _event_stream(body: AsyncIterator[bytes], ping_s: float, rid: str) -> EventSourceResponse:
    """The SSE response of ``body``: ``: ping`` comments every ``ping_s`` seconds, sends bounded in time."""
    response = _EventStream(
        body,
        headers={"Cache-Control": "no-cache"},
        ping=ping_s,
        sep="\n",
        ping_message_factory=_ping,
        send_timeout=SSE_SEND_TIMEOUT_S,
    )
    response.rid = rid
    return response


async def _stream(
    run: _Run, fmt: _Formatter, rid: str, include_usage: bool, prompt_tokens: int, announce: bool
) -> AsyncIterator[bytes]:
    """The SSE body: ``announce`` sends a comment first (headers and first bytes now, while queued)."""
    choices: dict[int, _Choice] = {h.index: _Choice() for h in run.handles}
    try:
        if announce:
            yield _PING
        failed = False
        while run.open:
            ev = await run.next()
            if ev.error is not None:
                yield _sse(_event_error(ev, rid).body())
                failed = True
                break
            if ev.finish_reason == "abort":  # the client is gone
                return
            chunk = fmt.chunk(choices[ev.index], ev)
            if chunk is not None:
                yield _sse(chunk)
        if include_usage and not failed:
            yield _sse(fmt.usage_chunk(choices, prompt_tokens))
    except Exception as e:  # a bug here must end the stream properly, without details
        log.error("request %s: stream failed", rid, exc_info=e)
        yield _sse(_internal(rid).body())
    finally:
        run.close()
    yield _sse("[DONE]")


class _Formatter:
    """OpenAI chat / completion shapes for one HTTP request."""

    def __init__(
        self, state: ServerState, rid: str, kind: str, req: ChatCompletionRequest | CompletionRequest
    ):
        assert state.token_strings is not None
        self.tokens = state.token_strings
        self.rid = rid
        self.kind = kind
        self.model = req.model
        self.created = now_ts()
        self.logprobs_on = req.logprobs if kind == "chat" else req.logprobs is not None
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _record(self, c: _Choice, ev: WorkerEvent) -> None:
        c.text.append(ev.text)
        if ev.finish_reason is not None:
            c.finish_reason = ev.finish_reason
            c.completion_tokens = ev.completion_tokens
            c.spec = ev.spec or SpecSummary()

    def accumulate(self, c: _Choice, ev: WorkerEvent) -> None:
        """Add an event to a non-streamed choice."""
        self._record(c, ev)
        if self.logprobs_on and ev.logprobs:
            c.logprobs.extend(ev.logprobs)

    def _logprobs(self, c: _Choice, items: list[Any]) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": [self._chat_lp(lp) for lp in items]}
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in items:
            text = self.tokens.text(lp.token_id)
            tokens.append(text)
            token_lps.append(lp.logprob)
            tops.append({self.tokens.text(t): v for t, v in lp.top})
            offsets.append(c.text_offset)
            c.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_lp(self, lp: Any) -> dict[str, Any]:
        return {
            **self._token(lp.token_id, lp.logprob),
            "top_logprobs": [self._token(t, v) for t, v in lp.top],
        }

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.tokens.text(token_id),
            "logprob": logprob,
            "bytes": list(self.tokens.bytes(token_id)),
        }

    def chunk(self, c: _Choice, ev: WorkerEvent) -> dict[str, Any] | None:
        """The SSE chunk for one event (None when the step added nothing visible)."""
        self._record(c, ev)
        lps = ev.logprobs if self.logprobs_on and ev.logprobs else None
        first = not c.sent_first
        if not (first and self.kind == "chat") and not ev.text and not lps and ev.finish_reason is None:
            return None
        c.sent_first = True
        lp_obj = self._logprobs(c, lps) if lps else None
        if self.kind == "chat":
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ev.text} if first else {"content": ev.text}
            )
            choice = {
                "index": ev.index,
                "delta": delta,
                "logprobs": lp_obj,
                "finish_reason": ev.finish_reason,
            }
        else:
            choice = {
                "index": ev.index,
                "text": ev.text,
                "logprobs": lp_obj,
                "finish_reason": ev.finish_reason,
            }
        return {**self._head(self.chunk_object), "choices": [choice]}

    def _totals(self, choices: dict[int, _Choice], prompt_tokens: int) -> dict[str, Any]:
        completion = sum(c.completion_tokens for c in choices.values())
        spec = sum((c.spec for c in choices.values()), SpecSummary())
        return {"usage": usage_dict(prompt_tokens, completion), "dflash": spec.to_dict()}

    def usage_chunk(self, choices: dict[int, _Choice], prompt_tokens: int) -> dict[str, Any]:
        """The final ``choices: []`` chunk with usage and the speculative summary."""
        return {**self._head(self.chunk_object), "choices": [], **self._totals(choices, prompt_tokens)}

    def final(self, choices: dict[int, _Choice], prompt_tokens: int) -> dict[str, Any]:
        """The non-streamed response."""
        out = []
        for index in sorted(choices):
            c = choices[index]
            lp_obj = self._logprobs(c, c.logprobs) if self.logprobs_on else None
            text = "".join(c.text)
            if self.kind == "chat":
                out.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": lp_obj,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                out.append(
                    {"index": index, "text": text, "logprobs": lp_obj, "finish_reason": c.finish_reason}
                )
        return {**self._head(self.object), "choices": out, **self._totals(choices, prompt_tokens)}
