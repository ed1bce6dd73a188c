"""One HTTP request's way to the worker: tokenization off the event loop, sampling parameters, and the ``Run``
that submits its engine requests (one per choice and prompt), gathers their events and aborts them when the
client goes away.

Tokenization runs in a thread pool; prompts longer than ``TOKENIZE_LIMIT_CHARS``, or from a body that needed a
parse helper, take one of ``TOKENIZE_CONCURRENCY`` slots (``TOKENIZE_MAX_WAITING`` wait, then 429).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from dflash_core.grammar import StructuredOutput
from dflash_core.sampling import SamplingParams
from server import affinity
from server.api_error import APIError, retry_later
from server.chat_request import ChatCompletionRequest
from server.completion_request import CompletionRequest
from server.context_length import resolve_max_tokens
from server.generation_config import GenerationDefaults
from server.handoff import RequestHandle, WorkerEvent
from server.parsing import Limiter
from server.worker import QueueFullError, Worker

log = logging.getLogger("dflash.server")

TOKENIZE_LIMIT_CHARS = 32 * 1024  # prompts longer than this take one of TOKENIZE_CONCURRENCY slots
TOKENIZE_CONCURRENCY = max(2, min(8, (os.cpu_count() or 2) // 2))
TOKENIZE_MAX_WAITING = 256  # long prompts waiting for a slot beyond which a 429 answers
NO_DEFAULTS = GenerationDefaults()


def tokenize_limiter() -> Limiter:
    """The limiter of long tokenizations (one per app)."""
    return Limiter(TOKENIZE_CONCURRENCY, TOKENIZE_MAX_WAITING, "long prompts")


async def prepare(limiter: Limiter, size: int, big: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """Run tokenization ``fn(*args)`` in the thread pool; a prompt over TOKENIZE_LIMIT_CHARS, or from a ``big``
    body (one that went to a parse helper), takes a slot of ``limiter``."""
    if size <= TOKENIZE_LIMIT_CHARS and not big:
        return await run_in_threadpool(affinity.unpinned(fn), *args)
    async with limiter:
        return await run_in_threadpool(affinity.unpinned(fn), *args)


SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    i: int,
    defaults: GenerationDefaults = NO_DEFAULTS,
    structured: StructuredOutput | None = None,
    vocab_size: int | None = None,
) -> SamplingParams:
    """The engine's parameters for choice ``i`` of ``req`` (400 when impossible); seeds differ per choice.

    A field the request omits takes the model's generation default (``--generation-config``), else the neutral
    value; ``structured`` is the request's output constraint (``server.constraints``). Stop strings do not apply to
    a required / named tool choice.
    """
    biases = req.token_biases()
    # A required / named tool choice's grammar decides where the answer ends: a stop string inside a call (a "{",
    # "<tool_call>") would cut it and return no call at all, so stop strings do not apply to it.
    forced_tools = isinstance(req, ChatCompletionRequest) and req.forced_tool()
    if vocab_size is not None and any(t >= vocab_size for t in biases):
        raise APIError(400, f"logit_bias: token ids must be in [0, {vocab_size})", param="logit_bias")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_first(req.temperature, defaults.temperature, 1.0)),
        top_p=float(_first(req.top_p, defaults.top_p, 1.0)),
        top_k=int(_first(req.top_k, defaults.top_k, 0)),
        min_p=float(_first(req.min_p, defaults.min_p, 0.0)),
        repetition_penalty=float(_first(req.repetition_penalty, defaults.repetition_penalty, 1.0)),
        presence_penalty=float(_first(req.presence_penalty, 0.0)),
        frequency_penalty=float(_first(req.frequency_penalty, 0.0)),
        logit_bias=biases,
        min_tokens=req.min_tokens,
        seed=None if req.seed is None else req.seed + i,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        stop=[] if forced_tools else req.stop_list(),
        structured=structured,
    )
    try:
        params.validate()
    except ValueError as e:  # each message starts with the field it is about
        field = str(e).split(maxsplit=1)[0] if str(e) else ""
        raise APIError(400, str(e), param=field if field in SAMPLING_FIELDS else None) from None
    return params


def _first(*values: Any) -> Any:
    """The first value that is not None."""
    return next(v for v in values if v is not None)


def completion_budget(
    requested: int | None, prompt_len: int, max_model_len: int, prompt_param: str, defaults: GenerationDefaults
) -> int:
    """``max_tokens`` of one prompt: the request's, else the model's default (``max_new_tokens``) within the
    context, else the rest of the context (400 ``context_length_exceeded`` when it cannot fit)."""
    budget = resolve_max_tokens(requested, prompt_len, max_model_len, prompt_param)
    if requested is None and defaults.max_tokens is not None:
        budget = min(budget, defaults.max_tokens)
    return budget


class Run:
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


def start_run(
    worker: Worker,
    request: Request,
    rid: str,
    prompts: list[list[int]],
    params: list[list[SamplingParams]],
    req: ChatCompletionRequest | CompletionRequest,
) -> Run:
    """Submit one engine request per (prompt, choice): 400 beyond the server's capacity, 429 when it is full.
    ``req`` gives the text options (``skip_special_tokens``, ``include_stop_str_in_output``)."""
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
                    loop=loop,
                    queue=queue,
                    request_id=f"{rid}-{index}",
                    skip_special_tokens=req.skip_special_tokens,
                    include_stop_str=req.include_stop_str_in_output,
                    record=req.store is not False,  # OpenAI's "store": false: never recorded
                )
            )
    if len(handles) > worker.capacity:
        raise APIError(
            400,
            f"{len(handles)} choices exceed what this server holds at once ({worker.capacity})",
            param="n",
        )
    try:
        return Run(worker, request, handles, queue)
    except QueueFullError as e:
        raise retry_later(429, f"{e}; retry later", "queue_full") from None
