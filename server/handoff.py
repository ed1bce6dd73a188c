"""What crosses from the worker thread to the asyncio event loops: the requests as the loop sees them
(`RequestHandle`), their events (`WorkerEvent`, `WorkerError`), and the thread-safe posting of events
(`EventPoster`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_core.outputs import TokenLogprob
    from dflash_core.sampling import SamplingParams
    from dflash_core.stats import SpecSummary

log = logging.getLogger("dflash.worker")

Delivery = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[Any]", Any]  # (loop, queue, event)


POLL_S = 0.002  # a CPU worker's loops look for events this often while they flow (`EventPoster`)
SLOW_GAP_POLLS = 5  # ... unless steps come further apart than this many polls


def _deliver(items: list[Delivery]) -> None:
    for _, queue, event in items:
        try:
            queue.put_nowait(event)
        except Exception:  # one request's queue must not cost the others their events
            log.exception("delivering a worker event failed")


def poll_interval(device: str) -> float | None:
    """How often an event loop looks for a worker's events while they flow (`EventPoster`): on a CPU, where the
    worker's thread computes the forwards and a wake-up of the loop is part of every step, `POLL_S`; elsewhere
    None (the worker posts while the device computes, where waking the loop costs the step nothing)."""
    return POLL_S if device.startswith("cpu") else None


class LookPace:
    """When a looking loop stops looking: once nothing has come for `idle_s`, or for twice the usual gap between
    looks that found events (steps slower than a poll: their next events are due), whichever is longer. Where that
    gap passes `SLOW_GAP_POLLS` polls, a wake-up costs little next to a step and looking stops at the first empty
    look. Times are the loop's clock, in seconds."""

    def __init__(self, poll_s: float, idle_s: float) -> None:
        self.poll_s, self.idle_s = poll_s, idle_s
        self.last_event = 0.0  # when the loop last found events
        self.gap = 0.0  # the usual time between two looks that found events (a running average)

    def found(self, now: float) -> None:
        """A look at `now` found events."""
        waited = now - self.last_event
        if self.last_event and waited < 1.0:  # a pause longer than a second is no step
            self.gap += 0.25 * (waited - self.gap)
        self.last_event = now

    def keep_looking(self, now: float) -> bool:
        """Whether a look at `now` that found nothing should be followed by another in `poll_s`."""
        due = 2 * self.gap if self.gap <= SLOW_GAP_POLLS * self.poll_s else 0.0
        return now - self.last_event < max(self.idle_s, due)


class _Mailbox:
    """One event loop's undelivered events, and whether the loop is looking for more by itself."""

    def __init__(self, loop: asyncio.AbstractEventLoop, poll_s: float, idle_s: float) -> None:
        self.loop = weakref.ref(loop)  # the poster's boxes are keyed by their loops, weakly: a box must not keep one
        self.poll_s = poll_s
        self.items: list[Delivery] = []
        self.lock = threading.Lock()
        self.looking = False  # a `drain` is scheduled on the loop: a post needs no wake-up (guarded by lock)
        self.pace = LookPace(poll_s, idle_s)

    def post(self, group: list[Delivery], wake: bool) -> None:
        """Worker thread: queue the events; wake the loop if it is not looking, or if `wake`."""
        loop = self.loop()
        with self.lock:
            if loop is None or loop.is_closed():  # nobody is listening any more: its events would only keep it
                self.items, self.looking = [], False
                return
            self.items.extend(group)
            if self.looking and not wake:
                return
            callback, self.looking = (self.deliver if self.looking else self.drain), True
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # it closed just now
            with self.lock:
                self.items, self.looking = [], False

    def deliver(self) -> None:
        """Loop thread: deliver what came (woken while looking; the looking goes on, and counts this step)."""
        with self.lock:
            items, self.items = self.items, []
        if items:
            self.pace.found(asyncio.get_running_loop().time())
        _deliver(items)

    def drain(self) -> None:
        """Loop thread: deliver what came; look again in `poll_s` while `LookPace` says more is due."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        with self.lock:
            items, self.items = self.items, []
            if not items and not self.pace.keep_looking(now):
                self.looking = False  # the next post wakes the loop
                return
        if items:
            self.pace.found(now)
            _deliver(items)
        loop.call_later(self.poll_s, self.drain)


class EventPoster:
    """Hands events from the worker thread to the event loops they belong to, in order, each loop's events of a
    call together (a step of N streams wakes the loop once, not N times).

    Waking a loop (`call_soon_threadsafe`: a write to its self-pipe, and the other core's wake-up) costs the
    posting thread 15 us after plain Python and 40-55 us right after the forward's vector work on the development
    VM: on a CPU, where the worker's thread computes the forwards itself, a twentieth of a plain step of the demo
    target. With `poll_s`, a loop that has been woken keeps looking for events every `poll_s` on its own timer for
    as long as they keep coming (`LookPace`: until twice the usual gap between them passes with none, or
    `idle_s`; steps more than `SLOW_GAP_POLLS` polls apart get one look each), and the worker wakes it only when
    it is not looking: a steady stream of steps faster than that costs the worker no wake-up at all, and an event
    that does not ask to `wake` the loop waits `poll_s` at most (asyncio's timers have a millisecond's
    resolution); the worker asks for a request's first text and its last event, so that TTFT and latency are not
    a poll late, and only a stream's tokens in between come in twos or threes at a CPU's step rate. Without
    `poll_s` every call wakes the loop, as on a GPU, where the worker posts while the device computes."""

    def __init__(self, poll_s: float | None = None, idle_s: float = 0.0) -> None:
        self.poll_s, self.idle_s = poll_s, idle_s
        self._boxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()

    def post_all(self, items: list[Delivery], wake: bool = True) -> None:
        """Worker thread: put each event on its queue from its loop's thread, in order. With `poll_s`, `wake`
        False leaves the events to a loop that is looking for them (a request's tokens after its first)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
        for item in items:
            by_loop.setdefault(item[0], []).append(item)
        for loop, group in by_loop.items():
            if self.poll_s is None:
                try:
                    loop.call_soon_threadsafe(_deliver, group)
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    pass
                continue
            box = self._boxes.get(loop)
            if box is None:
                box = self._boxes[loop] = _Mailbox(loop, self.poll_s, self.idle_s)
            box.post(group, wake)


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
