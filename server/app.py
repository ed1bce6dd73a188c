"""The HTTP face: ``create_app(settings)`` and its routes.

Routes validate and tokenize, hand ``RequestHandle`` objects to the worker thread, and turn the
``WorkerEvent`` objects that come back into OpenAI responses or SSE chunks. Nothing here touches a
tensor; models are loaded in a background thread so that ``/health`` answers 503 meanwhile.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash_core.loading import DEMO_TARGET, LoadedModels, load_models
from dflash_core.sampling import SamplingParams
from server import __version__
from server.detokenize import TokenStrings
from server.metrics import ServerMetrics
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now_ts,
    usage_dict,
    validation_error_to_api,
)
from server.settings import Settings
from server.worker import QueueFullError, RequestHandle, SpecSummary, Worker, WorkerEvent

log = logging.getLogger("dflash.server")

MAX_BODY_BYTES = 8 * 1024 * 1024
DRAIN_BODY_BYTES = 64 * 1024 * 1024  # beyond the limit, read (and drop) this much so the client sees the 413
RETRY_AFTER_S = 1
_CLIENT_GONE = APIError(499, "client disconnected", code="client_closed_request")
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tools",
        "documents",
        "chat_template",
        "tokenizer_kwargs",
    }
)


@dataclass
class ServerState:
    """What the routes share: settings, the loaded models, the worker, the metrics."""

    settings: Settings
    models: LoadedModels | None = None
    worker: Worker | None = None
    metrics: ServerMetrics | None = None
    token_strings: TokenStrings | None = None
    served_model_name: str = ""
    load_error: str | None = None
    created: int = field(default_factory=now_ts)

    @property
    def ready(self) -> bool:
        """Models loaded and the worker running."""
        return self.worker is not None and self.worker.is_alive()

    def install(self, models: LoadedModels) -> None:
        """Start serving ``models``: metrics, worker thread."""
        s = self.settings
        self.served_model_name = s.served_model_name or default_model_name(models.target_name)
        self.metrics = ServerMetrics(
            block_size=models.block_size,
            target=models.target_name,
            draft=models.draft_name or "",
            device=models.device,
            backend=models.backend,
            max_model_len=models.engine.max_model_len,
        )
        self.token_strings = TokenStrings(models.tokenizer)
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
            log.exception("loading the models failed")
            self.load_error = f"{type(e).__name__}: {e}"
            if on_error is not None:
                on_error(self.load_error)


def default_model_name(target: str) -> str:
    """The API's model name when none is configured: the target's folder name (or hub id)."""
    path = Path(target)
    if path.exists():
        if path.resolve() == DEMO_TARGET.resolve():
            return "dflash-demo"
        return path.resolve().name
    return target


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
        if state.worker is not None:
            await run_in_threadpool(state.worker.stop)

    app = FastAPI(title="dflash-serve", version=__version__, lifespan=lifespan)
    app.state.dflash = state
    _install_error_handlers(app)
    _install_routes(app, state)
    return app


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

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(
            error_body(f"internal server error: {type(e).__name__}", "server_error"), status_code=500
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
        )


def _check_ready(state: ServerState) -> tuple[LoadedModels, Worker]:
    if state.models is None or state.worker is None or not state.worker.is_alive():
        message = f"model failed to load: {state.load_error}" if state.load_error else "model is loading"
        raise APIError(
            503,
            message,
            type="service_unavailable",
            code="model_not_ready",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
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


def _parse(model: type[BaseModel], body: bytes) -> Any:
    if not body.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error_to_api(e) from None


def _check_model(state: ServerState, name: str) -> None:
    if name != state.served_model_name:
        raise APIError(
            404,
            f"the model '{name}' does not exist; this server serves '{state.served_model_name}'",
            param="model",
            code="model_not_found",
        )


# --- request preparation -----------------------------------------------------------------------------------


def _chat_prompt(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """Render the chat template and tokenize (runs in a thread pool)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    bad = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise APIError(
            400, f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs"
        )
    kwargs.setdefault("add_generation_prompt", True)
    messages = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        messages.append(msg)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:  # e.g. roles that do not alternate
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _completion_prompts(tokenizer: Any, req: CompletionRequest, vocab_size: int) -> list[list[int]]:
    """Tokenize each prompt of a completion request (runs in a thread pool)."""
    out = []
    for p in req.prompts():
        if isinstance(p, str):
            out.append(list(tokenizer(p)["input_ids"]))
        else:
            if any(t < 0 or t >= vocab_size for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
            out.append(list(p))
    return out


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int, prompt_param: str) -> int:
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
        raise APIError(
            429,
            f"{e}; retry later",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None


def _event_error(ev: WorkerEvent) -> APIError:
    assert ev.error is not None
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


def _sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


# --- routes ------------------------------------------------------------------------------------------------


def _install_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
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
                    "root": models.target_name,
                    "max_model_len": models.engine.max_model_len,
                    "dflash": {"draft": models.draft_name, "block_size": models.block_size},
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_auth(state, request)
        models, worker = _check_ready(state)
        req: ChatCompletionRequest = _parse(ChatCompletionRequest, await _read_body(request))
        _check_model(state, req.model)
        prompt = await run_in_threadpool(_chat_prompt, models.tokenizer, req)
        max_tokens = _max_tokens(
            req.requested_max_tokens(), len(prompt), models.engine.max_model_len, "messages"
        )
        params = [_sampling(req, max_tokens, req.num_logprobs(), i) for i in range(req.n)]
        rid = new_id("chatcmpl")
        run = _start_run(worker, request, rid, [prompt], [params], req.stop_list())
        return await _respond(state, run, rid, req, kind="chat", prompt_tokens=len(prompt))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_auth(state, request)
        models, worker = _check_ready(state)
        req: CompletionRequest = _parse(CompletionRequest, await _read_body(request))
        _check_model(state, req.model)
        vocab = len(models.tokenizer)
        prompts = await run_in_threadpool(_completion_prompts, models.tokenizer, req, vocab)
        params = []
        for prompt in prompts:
            max_tokens = _max_tokens(req.max_tokens, len(prompt), models.engine.max_model_len, "prompt")
            params.append([_sampling(req, max_tokens, req.logprobs, i) for i in range(req.n)])
        rid = new_id("cmpl")
        run = _start_run(worker, request, rid, prompts, params, req.stop_list())
        return await _respond(
            state, run, rid, req, kind="completion", prompt_tokens=sum(len(p) for p in prompts)
        )


async def _respond(
    state: ServerState,
    run: _Run,
    rid: str,
    req: ChatCompletionRequest | CompletionRequest,
    kind: str,
    prompt_tokens: int,
) -> Response:
    """Wait for the first event (so an early failure is a plain HTTP error), then answer or stream."""
    try:
        first = await run.peek()
    except BaseException:
        run.close()
        raise
    if first.error is not None:
        run.close()
        return _error_response(_event_error(first))
    if first.finish_reason == "abort":  # the client left while the request was queued
        run.close()
        return _error_response(_CLIENT_GONE)
    fmt = _Formatter(state, rid, kind, req)
    if req.stream:
        return StreamingResponse(
            _stream(run, fmt, req.include_usage(), prompt_tokens),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    choices: dict[int, _Choice] = {h.index: _Choice() for h in run.handles}
    try:
        while run.open:
            ev = await run.next()
            if ev.error is not None:
                return _error_response(_event_error(ev))
            fmt.accumulate(choices[ev.index], ev)
    finally:
        run.close()
    if any(c.finish_reason == "abort" for c in choices.values()):
        return _error_response(_CLIENT_GONE)
    return JSONResponse(fmt.final(choices, prompt_tokens))


async def _stream(run: _Run, fmt: _Formatter, include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    choices: dict[int, _Choice] = {h.index: _Choice() for h in run.handles}
    try:
        while run.open:
            ev = await run.next()
            if ev.error is not None:
                yield _sse(_event_error(ev).body())
                break
            if ev.finish_reason == "abort":  # the client is gone
                return
            chunk = fmt.chunk(choices[ev.index], ev)
            if chunk is not None:
                yield _sse(chunk)
        else:
            if include_usage:
                yield _sse(fmt.usage_chunk(choices, prompt_tokens))
        yield _sse("[DONE]")
    finally:
        run.close()


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
