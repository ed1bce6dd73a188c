"""What crosses from the worker thread to the asyncio event loops: the requests as the loop sees them
(`RequestHandle`), their events (`WorkerEvent`, `WorkerError`), and the thread-safe posting of events."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_core.outputs import TokenLogprob
    from dflash_core.sampling import SamplingParams
    from dflash_core.stats import SpecSummary

log = logging.getLogger("dflash.worker")

Delivery = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[Any]", Any]  # (loop, queue, event)


def _deliver(items: list[Delivery]) -> None:
    for _, queue, event in items:
        try:
            queue.put_nowait(event)
        except Exception:  # one request's queue must not cost the others their events
            log.exception("delivering a worker event failed")


def post_all(items: list[Delivery]) -> None:
    """Put each event on its queue from its loop's thread, in order: one wake-up of each loop for all of its
    events, rather than one per event (a step of N streams wakes the loop once)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
    for item in items:
        by_loop.setdefault(item[0], []).append(item)
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, group)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass
class WorkerError:
    """A failure of one request: HTTP status, OpenAI error type, message."""

    status: int
    type: str
    message: str


@dataclass
class WorkerEvent:
    """What one engine step produced for one request (one SSE chunk at most)."""

    index: int
    text: str = ""
    num_tokens: int = 0  # tokens committed this step (counted in usage)
    logprobs: list[TokenLogprob] | None = None  # one per token whose text is part of the output
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last event
    completion_tokens: int = 0  # on the last event: tokens of the whole request
    spec: SpecSummary | None = None  # on the last event
    cached_tokens: int = 0  # on the last event: prompt tokens served from the prefix cache (usage)
    error: WorkerError | None = None  # the request failed (last event)


_ids = itertools.count()


@dataclass(eq=False)
class RequestHandle:
    """One engine request as seen by the event loop (a choice of an HTTP request)."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams  # its `stop` strings are applied here, by the request's OutputText
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[WorkerEvent]
    request_id: str = ""  # for logs: "<response id>-<choice index>"
    skip_special_tokens: bool = True  # the output text's detokenization (vLLM's request field)
    include_stop_str: bool = False  # a stop string stays in the text (vLLM's include_stop_str_in_output)
    record: bool = False  # hand it to the worker's traffic recorder when it finishes (not with "store": false)
    arrival: float = field(default_factory=time.monotonic)
    uid: int = field(default_factory=lambda: next(_ids))

    def post(self, event: WorkerEvent) -> None:
        """Hand an event to the event loop (thread-safe)."""
        post_all([(self.loop, self.queue, event)])
