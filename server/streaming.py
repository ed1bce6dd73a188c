"""Server-sent events: the response class, keep-alive pings, the first-event wait and the body of a stream.

Every stream sends its headers and a ``: ping`` comment first, always: as soon as the first event is there, or
after ``STREAM_HEADERS_GRACE_S`` at most (during which an early failure is still a plain HTTP error), whichever
comes first. Then one ``data:`` event per engine step, a comment every ``sse_ping_interval`` seconds (sent whether
or not data flows, so that idle-timeout proxies keep a queued or prefilling stream), and ``data: [DONE]``. Errors
after the headers are an error event followed by ``data: [DONE]``.
A client that stops reading is dropped, and its requests aborted, once a send has waited ``SSE_SEND_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import SendTimeoutError
from starlette.types import Receive, Scope, Send

from server.errors import event_error, internal_error
from server.formatters import Choice, ResponseFormatter
from server.handoff import WorkerEvent
from server.protocol import usage_dict
from server.runs import Run

log = logging.getLogger("dflash.server")

SSE_SEND_TIMEOUT_S = 60.0  # a stream whose client has not taken a chunk for this long is aborted
STREAM_HEADERS_GRACE_S = 0.1  # a stream waits this long at most for its first event before it sends its headers
PING = b": ping\n\n"


def sse(obj: dict[str, Any] | str) -> bytes:
    """One ``data:`` event (a JSON object, or a literal such as ``[DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _ping() -> ServerSentEvent:
    return ServerSentEvent(comment="ping", sep="\n")


async def first_event(run: Run, stream: bool) -> WorkerEvent | None:
    """The first event, left in place; a stream waits ``STREAM_HEADERS_GRACE_S`` at most (None when it has not
    come by then), a non-streamed request as long as it takes."""
    try:
        if not stream:
            return await run.peek()
        return await asyncio.wait_for(run.peek(), STREAM_HEADERS_GRACE_S)
    except TimeoutError:
        return None
    except BaseException:
        run.close()
        raise


class EventStream(EventSourceResponse):
    """An SSE response that ends quietly (one log line) when its client stops reading."""

    rid = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:  # the body iterator was closed first: its requests are aborted
            log.info("request %s: the client took no data for %.0f s; stream aborted", self.rid, self.send_timeout)


def event_stream(body: AsyncIterator[bytes], ping_s: float, rid: str) -> EventSourceResponse:
    """The SSE response of ``body``: ``: ping`` comments every ``ping_s`` seconds, sends bounded in time."""
    response = EventStream(
        body,
        headers={"Cache-Control": "no-cache"},
        ping=ping_s,
        sep="\n",
        ping_message_factory=_ping,
        send_timeout=SSE_SEND_TIMEOUT_S,
    )
    response.rid = rid
    return response


async def stream_body(
    run: Run, fmt: ResponseFormatter, rid: str, include_usage: bool, prompt_tokens: int, continuous: bool = False
) -> AsyncIterator[bytes]:
    """The SSE body: a ``: ping`` comment first (headers and first bytes at once, even while queued), the events;
    ``continuous``: each chunk carries its choice's usage so far (vLLM's ``continuous_usage_stats``)."""
    choices: dict[int, Choice] = {h.index: fmt.new_choice() for h in run.handles}
    try:
        yield PING
        failed = False
        while run.open:
            ev = await run.next()
            if ev.error is not None:
                yield sse(event_error(ev, rid).body())
                failed = True
                break
            if ev.finish_reason == "abort":  # the client is gone
                return
            chunk = fmt.chunk(choices[ev.index], ev)
            if chunk is not None:
                if continuous:
                    chunk["usage"] = usage_dict(prompt_tokens, choices[ev.index].streamed_tokens)
                yield sse(chunk)
        if include_usage and not failed:
            yield sse(fmt.usage_chunk(choices, prompt_tokens))
    except Exception as e:  # a bug here must end the stream properly, without details
        log.error("request %s: stream failed", rid, exc_info=e)
        yield sse(internal_error(rid).body())
    finally:
        run.close()
    yield sse("[DONE]")
