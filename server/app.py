"""The HTTP face: ``create_app(settings)`` and the routes, over the state they share (``server.state.ServerState``).

Routes check (``server.checks``), parse (``server.parsing``: in place when cheap, in a helper process otherwise,
so that no body stalls the event loop or the engine), tokenize in a thread pool (``server.runs``: long texts at
most ``TOKENIZE_CONCURRENCY`` at once, after a cheap check that refuses text that cannot fit the context,
``server.prompts``), hand ``RequestHandle`` objects to the worker thread (``server.worker``), and turn the
``WorkerEvent`` objects that come back into OpenAI responses (``server.formatters``) or SSE streams
(``server.streaming``). Errors are OpenAI envelopes (``server.errors``). Nothing here touches a tensor; models are
loaded in a background thread so that ``/health`` answers 503 meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import AppStatus
from starlette.concurrency import run_in_threadpool

from dflash_core.loading import LoadedModels
from server import __version__, affinity
from server.admin_request import AdminDraftRequest
from server.api_error import APIError
from server.chat_request import ChatCompletionRequest
from server.checks import check_admin, check_auth, check_content_type, check_model, check_ready, read_body
from server.completion_request import CompletionRequest
from server.draft_swap import DraftSwapError
from server.errors import CLIENT_GONE, error_response, event_error, install_error_handlers
from server.formatters import ChatFormatter, Choice, CompletionFormatter, ResponseFormatter
from server.parsing import is_cheap
from server.protocol import body_schema, new_id, parse_request, request_schemas
from server.runs import Run, completion_budget, prepare, sampling_params, start_run
from server.settings import Settings
from server.state import ServerState, display_name
from server.streaming import event_stream, first_event, stream_body
from server.tokenize_routes import install_tokenize_routes
from server.worker import Worker


def create_app(
    settings: Settings, models: LoadedModels | None = None, on_load_error: Callable[[str], None] | None = None
) -> FastAPI:
    """The FastAPI app. Without ``models`` they are loaded in a background thread at start-up."""
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()  # --one-core: this loop's thread shares the worker's core
        if state.worker is not None:
            pass  # installed by the caller before the app started (a Ray replica warms up inside its __init__)
        elif models is not None:
            state.install(models)
        else:
            threading.Thread(target=state.load, args=(on_load_error,), name="dflash-load", daemon=True).start()
        yield
        await state.parser.close()
        if state.chat_setup is not None:
            await state.chat_setup.close()  # the grammar helper processes
        if state.worker is not None:
            await run_in_threadpool(state.worker.stop)
        if state.adapter is not None:
            await run_in_threadpool(state.adapter.stop)  # a training child is terminated
        if state.recorder is not None:
            await run_in_threadpool(state.recorder.close)  # what is queued is written

    # sse-starlette would cancel every stream as soon as uvicorn is asked to exit; server.__main__ drains them.
    if hasattr(AppStatus, "disable_automatic_graceful_drain"):
        AppStatus.disable_automatic_graceful_drain()
    app = FastAPI(title="dflash-serve", version=__version__, lifespan=lifespan)
    app.state.dflash = state
    install_error_handlers(app)
    origins = settings.origins()
    if origins:  # --allowed-origins: browsers on those origins may call the API
        app.add_middleware(
            CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"], allow_credentials=False
        )
    _install_routes(app, state)
    install_tokenize_routes(app, state)
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

    # HEAD for load balancers' probes (uvicorn sends no body); one operation in the OpenAPI schema
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            check_ready(state)
        assert state.metrics is not None
        body, content_type = state.metrics.render()
        return Response(body, media_type=None, headers={"Content-Type": content_type})

    def model_card() -> dict[str, Any]:
        models, _ = check_ready(state)
        return {
            "id": state.served_model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "dflash-serve",
            "root": display_name(models.target_name),
            "max_model_len": models.engine.max_model_len,
            "dflash": {"draft": display_name(models.draft_name) or None, "block_size": models.block_size,
                       "draft_version": models.engine.draft_version},
        }

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        check_auth(request, state.settings.api_key)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        check_auth(request, state.settings.api_key)
        card = model_card()
        check_model(model_id, state.served_model_name)
        return card

    @app.get("/v1/admin/draft")
    async def current_draft(request: Request) -> dict[str, Any]:
        check_admin(request, state.settings.api_key)
        check_ready(state)
        assert state.swapper is not None
        return {"object": "draft", "path": state.swapper.current, "draft_version": state.swapper.version}

    @app.post("/v1/admin/draft", openapi_extra=body_schema("AdminDraftRequest"))
    async def swap_draft(request: Request) -> JSONResponse:
        """Replace the draft with the one in the folder `path` (a local folder on the server), between two steps:
        running requests go on without an error or a changed token."""
        check_admin(request, state.settings.api_key)
        await check_content_type(request)
        check_ready(state)
        req = parse_request("admin_draft", await read_body(request))
        assert isinstance(req, AdminDraftRequest) and state.swapper is not None
        try:
            done = await run_in_threadpool(affinity.unpinned(state.swapper.swap), req.path)  # never the worker's core
        except DraftSwapError as exc:
            raise APIError(exc.status, str(exc), param="path", code="draft_not_swapped") from None
        return JSONResponse({"object": "draft", "path": done.draft, "draft_version": done.draft_version,
                             "restarted_requests": done.restarted_requests,
                             "load_seconds": round(done.load_seconds, 3), "swap_seconds": round(done.swap_seconds, 3)})

    @app.post("/v1/chat/completions", openapi_extra=body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        rid, worker, max_model_len, body, req = await _admit(state, request, "chat", "chatcmpl")
        assert isinstance(req, ChatCompletionRequest) and state.prompts is not None and state.token_strings is not None
        # every message and part costs template work even when empty: they count like characters
        size = sum(len(m.text()) + 1 + (len(m.content) if isinstance(m.content, list) else 0) for m in req.messages)
        size += sum(len(json.dumps(t.function.parameters or {})) for t in req.tools or [])
        assert state.chat_setup is not None
        await state.chat_setup.check(req, request)  # its grammar tried in a helper process first: a crash is a 400
        # the prompt, then the output plan and its grammar compiled (seconds for a big schema): off the event loop,
        # and off the engine's thread, which only copies the compiled grammar
        defaults = state.generation_defaults

        def budget(prompt_len: int) -> int:  # the completion budget: the thinking of a forced tool call fits in it
            return completion_budget(req.requested_max_tokens(), prompt_len, max_model_len, "messages", defaults)

        prompt, max_tokens, plan, structured = await prepare(
            state.tokenize_limiter, size, not is_cheap(body), state.chat_setup.prepare, state.prompts, req, budget
        )
        vocab = state.prompts.vocab_size
        params = [
            sampling_params(req, max_tokens, req.num_logprobs(), i, defaults, structured, vocab) for i in range(req.n)
        ]
        run = start_run(worker, request, rid, [prompt], [params], req)
        fmt = ChatFormatter(state.token_strings, rid, req, plan)
        return await _respond(state, run, rid, req, fmt, prompt_tokens=len(prompt))

    @app.post("/v1/completions", openapi_extra=body_schema("CompletionRequest"))
    async def completions(request: Request) -> Response:
        rid, worker, max_model_len, body, req = await _admit(state, request, "completion", "cmpl")
        assert isinstance(req, CompletionRequest) and state.prompts is not None and state.token_strings is not None
        size = sum(len(p) for p in req.prompts() if isinstance(p, str))
        prompts = await prepare(state.tokenize_limiter, size, not is_cheap(body), state.prompts.completions, req)
        params = []
        defaults, vocab = state.generation_defaults, state.prompts.vocab_size
        for prompt in prompts:
            max_tokens = completion_budget(req.max_tokens, len(prompt), max_model_len, "prompt", defaults)
            choices = [sampling_params(req, max_tokens, req.logprobs, i, defaults, None, vocab) for i in range(req.n)]
            params.append(choices)
        run = start_run(worker, request, rid, prompts, params, req)
        fmt = CompletionFormatter(state.token_strings, rid, req)
        return await _respond(state, run, rid, req, fmt, prompt_tokens=sum(len(p) for p in prompts))


async def _admit(
    state: ServerState, request: Request, kind: str, id_prefix: str
) -> tuple[str, Worker, int, bytes, ChatCompletionRequest | CompletionRequest]:
    """The checks and parsing every generation request passes, in order: (response id, worker, the engine's
    context length, raw body, parsed request)."""
    rid = request.state.request_id = new_id(id_prefix)
    check_auth(request, state.settings.api_key)
    await check_content_type(request)
    models, worker = check_ready(state)
    max_model_len = models.engine.max_model_len
    body = await read_body(request)
    req = await state.parser.parse(kind, body, max_model_len)
    check_model(req.model, state.served_model_name)
    return rid, worker, max_model_len, body, req


async def _respond(
    state: ServerState,
    run: Run,
    rid: str,
    req: ChatCompletionRequest | CompletionRequest,
    fmt: ResponseFormatter,
    prompt_tokens: int,
) -> Response:
    """Answer or stream; a failure that comes before the response starts is a plain HTTP error."""
    first = await first_event(run, req.stream)
    if first is not None and first.error is not None:
        run.close()
        return error_response(event_error(first, rid))
    if first is not None and first.finish_reason == "abort":  # the client left while the request was queued
        run.close()
        return error_response(CLIENT_GONE)
    if req.stream:
        return event_stream(
            stream_body(run, fmt, rid, req.include_usage(), prompt_tokens, req.continuous_usage()),
            state.settings.sse_ping_interval,
            rid,
        )
    choices: dict[int, Choice] = {h.index: fmt.new_choice() for h in run.handles}
    try:
        while run.open:
            ev = await run.next()
            if ev.error is not None:
                return error_response(event_error(ev, rid))
            fmt.accumulate(choices[ev.index], ev)
    finally:
        run.close()
    if any(c.finish_reason == "abort" for c in choices.values()):
        return error_response(CLIENT_GONE)
    return JSONResponse(fmt.final(choices, prompt_tokens))
