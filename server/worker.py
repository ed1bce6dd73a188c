"""The single worker thread that owns the Engine, and its bridge to asyncio.

The event loop submits ``RequestHandle`` objects; the thread admits up to ``max_running`` of them into
the engine (the rest wait in a bounded queue), calls ``Engine.step()``, detokenizes every output right
away (stop strings are found here, so a stopped request is aborted before it wastes another step),
and posts ``WorkerEvent`` objects to each request's asyncio queue (``EventPoster``): a step's events together, so
a step of many streams wakes the event loop once (on a CPU, not even that while the loop looks for them by
itself); where the forwards wait for the device without the GIL, held until the next step's forward does
(``dflash_core/overlap.py``): the loop's work overlaps it.
No model call ever runs on the event loop.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dflash_core.detokenize import OutputText
from dflash_core.overlap import hold, run_held
from dflash_core.stats import SpecSummary
from server.handoff import Delivery, EventPoster, RequestHandle, WorkerError, WorkerEvent
from server.serving_engine import ServingEngine
from server.traffic import TrafficSink, finished

if TYPE_CHECKING:
    from dflash_core.kv.pool import KVStats
    from dflash_core.outputs import StepOutput
    from server.metrics import ServerMetrics

log = logging.getLogger("dflash.worker")
IDLE_WAKE_S = 1.0
SHUTTING_DOWN = "server is shutting down"


class QueueFullError(Exception):
    """The waiting queue is full (answered with 429)."""


@dataclass(eq=False)
class _Request:
    """Worker-side state of one request."""

    handle: RequestHandle
    text: OutputText  # detokenizer + stop strings
    rid: int | None = None
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    done: bool = False  # the client has its last event
    shown: bool = False  # an event with text has been posted (the first one wakes the event loop: `_post`)
    output_ids: list[int] = field(default_factory=list)  # the output's token ids (kept only to be recorded)


class Worker:
    """Owns the engine in one thread; thread-safe ``submit`` / ``abort`` for the event loop."""

    def __init__(
        self, engine: ServingEngine, tokenizer: Any, metrics: ServerMetrics, *, max_running: int, max_waiting: int,
        warm_up: Callable[[], Any] | None = None, on_warm_up_error: Callable[[Exception], None] | None = None,
        on_ready: Callable[[], None] | None = None, recorder: TrafficSink | None = None, model_name: str = "",
        hold_events: bool = False, poll_events_s: float | None = None,
    ) -> None:
        """``warm_up`` (``Engine.warm_up``) runs first on the worker's own thread, the one that runs the steps
        (recorded CUDA graphs are per thread); the worker is ``ready`` once it has run. If it raises, the thread
        ends and ``on_warm_up_error`` gets the exception. ``on_ready`` runs on the worker's thread after the
        warm-up, before the first request (the server pins threads there); if it raises, the error is logged.
        ``hold_events``: a step's events wait for the next forward's wait for the device (where holding pays,
        ``dflash_core.overlap.pays_to_hold``) instead of being posted when the step ends. ``poll_events_s``: the
        event loops look for events that often while they flow, instead of being woken for each step
        (``EventPoster``; ``handoff.poll_interval`` says where)."""
        self._engine = engine
        self._poster = EventPoster(poll_events_s)
        self._hold_events = hold_events
        self._recorder, self._model_name = recorder, model_name  # --record-traffic: finished requests go there
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._max_running = max_running
        self._capacity = max_running + max_waiting
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_system = 0  # submitted and not yet answered (guarded by _lock)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._active: dict[int, _Request] = {}  # engine request id -> request (until released)
        self._by_uid: dict[int, _Request] = {}
        self._closed: WorkerError | None = None  # set by fail_all: later requests fail at once with it
        self._outbox: list[Delivery] | None = None  # a step's events, posted together
        self._outbox_wakes = False  # ... and whether one of them wakes the event loop (`_post`)
        self._kv_seen: KVStats | None = None  # the KV snapshot the metrics last had
        self._thread = threading.Thread(target=self._run, name="dflash-worker", daemon=True)
        self._warm_up, self._on_warm_up_error, self._on_ready = warm_up, on_warm_up_error, on_ready
        self._warm = threading.Event()  # set once warmed up: requests are served from then on
        if warm_up is None:
            self._warm.set()
        self.num_running = 0
        self.num_waiting = 0

    # --- event-loop side --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still in flight and end the thread."""
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join(timeout)

    @property
    def capacity(self) -> int:
        """Requests the server holds at once (running + waiting)."""
        return self._capacity

    @property
    def thread_id(self) -> int | None:
        """The worker thread's native id (None before it starts)."""
        return self._thread.native_id

    def is_alive(self) -> bool:
        """Whether the worker thread runs."""
        return self._thread.is_alive()

    @property
    def ready(self) -> bool:
        """Warmed up, and the thread runs: requests are served."""
        return self._warm.is_set() and self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet answered (running, waiting, or on their way in)."""
        with self._lock:
            return self._in_system

    def fail_all(self, message: str = SHUTTING_DOWN) -> None:
        """Answer every request in flight, and every later one, with a 503 (the server is going away): running ones
        get an error event after their tokens (a stream ends with it and ``[DONE]``), waiting ones a 503 envelope."""
        self._inbox.put(("fail_all", WorkerError(503, "service_unavailable", message)))

    def submit(self, handles: list[RequestHandle]) -> None:
        """Queue the requests of one HTTP request, all or none (QueueFullError when full)."""
        with self._lock:
            if self._in_system + len(handles) > self._capacity:
                raise QueueFullError(f"server is at capacity ({self._capacity} requests in flight)")
            self._in_system += len(handles)
        for h in handles:
            self._inbox.put(("add", h))

    def abort(self, handle: RequestHandle) -> None:
        """The client is gone: drop the request at the next step."""
        self._inbox.put(("abort", handle))

    def between_steps(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` on the worker thread at the next step boundary (no step runs meanwhile: a draft swap); the
        future gets its result or its exception."""
        done: Future[Any] = Future()
        self._inbox.put(("call", (fn, done)))
        if not self._thread.is_alive():  # no step boundary will come (cancelled here or by `_shutdown`)
            done.cancel()
        return done

    # --- worker thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        if self._warm_up is not None:  # the thread that runs the steps warms up (CUDA graphs are per thread)
            t0 = time.perf_counter()
            try:
                self._warm_up()
            except Exception as exc:
                if self._on_warm_up_error is not None:
                    self._on_warm_up_error(exc)
                self._shutdown()
                return
            log.info("warmed up on the worker thread in %.1f s", time.perf_counter() - t0)
        if self._on_ready is not None:
            try:
                self._on_ready()
            except Exception:
                log.exception("the worker's start-up hook failed; serving on")
        self._warm.set()
        while True:
            try:
                if self._iteration():
                    break
            except Exception:  # a bug here must not kill the thread that serves everyone
                log.exception("worker iteration failed")
                time.sleep(0.01)
        self._shutdown()

    def _iteration(self) -> bool:
        """Take commands, admit, step once; True when asked to stop."""
        cmds: list[tuple[str, Any]] = []
        if not self._waiting and not self._active:  # idle: block, waking now and then for the summary log
            run_held()  # no forward comes to post the last step's events
            try:
                cmds.append(self._inbox.get(timeout=IDLE_WAKE_S))
            except queue.Empty:
                self._metrics.maybe_log_summary(time.monotonic())
                return False
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for kind, obj in cmds:
            if kind == "stop":
                return True
            if kind == "add":
                self._add(obj)
            elif kind == "abort":
                self._abort(obj)
            elif kind == "fail_all":
                self._closed = obj
                self._fail_all(obj)
            elif kind == "call" and obj[1].set_running_or_notify_cancel():  # not given up by its caller
                run_held()  # a call (a draft swap) may take seconds: the last step's events go first
                try:
                    obj[1].set_result(obj[0]())
                except Exception as exc:
                    obj[1].set_exception(exc)
        self._admit()
        self._publish_queue_state()
        if self._active:
            self._step()
            self._publish_queue_state()
            self._metrics.set_estimated_speedup(self._engine.estimated_speedup())
            kv = self._engine.kv_stats()  # a KV pool snapshot: cheap; most steps leave it as it was
            if kv is not None and kv != self._kv_seen:
                self._metrics.observe_kv(kv)
                self._kv_seen = kv
        self._metrics.maybe_log_summary(time.monotonic())
        return False

    def _publish_queue_state(self) -> None:
        held_back = self._engine.num_waiting()  # in the engine, but waiting for KV memory
        running, waiting = len(self._active) - held_back, len(self._waiting) + held_back
        if running != self.num_running or waiting != self.num_waiting:  # twice a step: the gauges' locks only on change
            self.num_running, self.num_waiting = running, waiting
            self._metrics.set_queue_state(running, waiting)

    def _add(self, h: RequestHandle) -> None:
        text = OutputText(self._tokenizer, h.prompt_token_ids, h.params.stop, h.skip_special_tokens, h.include_stop_str)
        r = _Request(handle=h, text=text)
        if self._closed is not None:
            self._fail(r, self._closed)
            return
        self._by_uid[h.uid] = r
        self._waiting.append(r)

    def _abort(self, h: RequestHandle) -> None:
        r = self._by_uid.get(h.uid)
        if r is None or r.done:
            return
        if r.rid is None:  # still waiting: never reached the engine
            self._waiting.remove(r)
            self._finish(r, "abort", now=time.monotonic())
            del self._by_uid[h.uid]
        else:
            self._engine.abort(r.rid)

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self._max_running:
            r = self._waiting.popleft()
            h = r.handle
            try:
                rid = self._engine.add_request(h.prompt_token_ids, h.params)
            except ValueError as e:
                self._fail(r, WorkerError(400, "invalid_request_error", str(e)))
                continue
            except Exception as e:
                log.exception("engine.add_request failed")
                self._fail(r, WorkerError(500, "server_error", f"engine error: {e}"))
                continue
            r.rid = rid
            r.admitted = time.monotonic()
            self._active[rid] = r

    def _step(self) -> None:
        self._outbox, self._outbox_wakes = [], False
        try:
            self._step_outputs()
        finally:
            outbox, wake, self._outbox = self._outbox, self._outbox_wakes, None
            run_held()  # the previous step's events, if this step had no forward to post them: order kept
            if outbox and self._hold_events:  # posted when the next forward waits for the device (or earlier)
                hold(lambda: self._poster.post_all(outbox, wake=wake))
            elif outbox:
                self._poster.post_all(outbox, wake=wake)

    def _post(self, h: RequestHandle, event: WorkerEvent, wake: bool = True) -> None:
        """Post now (after what is held, in order), or with the rest of the step's events while a step's outputs
        are processed. ``wake``: the event loop is woken for it even while it looks for events by itself (a
        request's first token and its end: its TTFT and its latency are not a poll late; ``EventPoster``)."""
        if self._outbox is None:
            run_held()
            self._poster.post_all([(h.loop, h.queue, event)], wake=wake)
        else:
            self._outbox.append((h.loop, h.queue, event))
            self._outbox_wakes |= wake

    def _step_outputs(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as e:
            log.exception("engine.step failed")
            live = [r for r in self._active.values() if not r.done]
            for r in live:
                self._fail(r, WorkerError(500, "server_error", f"engine error: {e}"))
                try:
                    self._engine.abort(r.rid)  # type: ignore[arg-type]
                except Exception:
                    log.exception("engine.abort failed")
            if not live:  # the engine keeps failing on requests nobody waits for: forget them
                for rid in list(self._active):
                    self._release(rid)
            return
        now = time.monotonic()
        for out in outputs:
            try:
                self._on_output(out, now)
            except Exception as e:
                log.exception("processing the output of request %s failed", out.request_id)
                r = self._active.get(out.request_id)
                if r is not None and not r.done:
                    self._fail(r, WorkerError(500, "server_error", f"output processing error: {e}"))
                    self._engine.abort(out.request_id)

    def _on_output(self, out: StepOutput, now: float) -> None:
        r = self._active.get(out.request_id)
        if r is None:
            return
        if r.done:  # answered already (stop string, error): wait for the engine to let go of it
            if out.finish_reason is not None:
                self._release(out.request_id)
            return
        if out.finish_reason == "error":
            self._metrics.observe_step(out, now)
            if out.error_type is not None:  # the request's own fault (its grammar cannot go on): a 400
                self._fail(r, WorkerError(400, out.error_type, out.error or "the request failed"))
            else:
                self._fail(r, WorkerError(500, "server_error", f"engine error: {out.error or 'unknown'}"))
            self._release(out.request_id)
            return
        if out.finish_reason == "abort":
            self._metrics.observe_step(out, now)
            self._finish(r, "abort", now)
            self._release(out.request_id)
            return

        step = r.text.step(out)
        kept, finish, text = step.token_ids, step.finish_reason, step.text
        logprobs = list(out.logprobs[: step.num_text_tokens]) if out.logprobs is not None else None
        if len(kept) != len(out.new_token_ids) or finish != out.finish_reason:
            out = dataclasses.replace(out, new_token_ids=kept, finish_reason=finish)
        self._metrics.observe_step(out, now)

        if kept:
            if r.first_token is None:
                r.first_token = now
            elif r.last_token is not None:
                gap = (now - r.last_token) / len(kept)
                r.itl.extend([gap] * len(kept))
            r.last_token = now
        r.num_tokens += len(kept)
        if self._recorder is not None and r.handle.record:
            r.output_ids.extend(kept)
        event = WorkerEvent(
            index=r.handle.index, text=text, num_tokens=len(kept), logprobs=logprobs, finish_reason=finish
        )
        if finish is None:
            # its first text (TTFT as the client sees it) wakes the loop
            self._post(r.handle, event, wake=bool(text) and not r.shown)
            r.shown = r.shown or bool(text)
            return
        self._finish(r, finish, now, event=event)
        if step.stopped_early:  # cut by a stop string: stop generating now; released when the engine reports the abort
            self._engine.abort(out.request_id)
        else:
            self._release(out.request_id)

    def _final_stats(self, r: _Request) -> tuple[SpecSummary, int]:  # the summary, prompt tokens from the cache
        if r.rid is None:
            return SpecSummary(), 0
        try:
            stats = self._engine.stats(r.rid)
            return stats.summary(), stats.cached_tokens
        except Exception:
            log.warning("engine.stats(%s) failed", r.rid, exc_info=True)
            return SpecSummary(), 0

    def _finish(self, r: _Request, reason: str, now: float, event: WorkerEvent | None = None) -> None:
        """Send the last event of a request and record it in the metrics."""
        if r.done:
            return
        r.done = True
        ev = event or WorkerEvent(index=r.handle.index)
        ev.finish_reason = reason
        ev.completion_tokens = r.num_tokens
        ev.spec, ev.cached_tokens = self._final_stats(r)
        self._release_capacity()
        self._post(r.handle, ev)
        self._observe_finished(r, reason, now, ev.spec)
        if self._recorder is not None and r.handle.record and reason in ("stop", "length"):  # it only queues it
            h = r.handle
            self._recorder.record(finished(h.request_id, self._model_name, h.prompt_token_ids, r.output_ids, reason,
                                           ev.spec))

    def _fail(self, r: _Request, error: WorkerError) -> None:
        """Fail one request alone."""
        if r.done:
            return
        r.done = True
        self._release_capacity()
        ev = WorkerEvent(index=r.handle.index, finish_reason="error", error=error, completion_tokens=r.num_tokens)
        self._post(r.handle, ev)
        self._observe_finished(r, "error", time.monotonic())
        if r.rid is None:
            self._by_uid.pop(r.handle.uid, None)

    def _observe_finished(self, r: _Request, reason: str, now: float, spec: SpecSummary | None = None) -> None:
        h, spec = r.handle, spec or self._final_stats(r)[0]
        start = r.admitted if r.admitted is not None else now
        ttft = None if r.first_token is None else r.first_token - h.arrival
        try:
            self._metrics.observe_finished(
                request_id=h.request_id, finish_reason=reason, prompt_tokens=len(h.prompt_token_ids),
                generation_tokens=r.num_tokens, mean_acceptance_length=spec.mean_acceptance_length,
                queue_time=start - h.arrival, ttft=ttft, e2e=now - h.arrival, inter_token_latencies=r.itl)
        except Exception:
            log.exception("metrics.observe_finished failed")

    def _release_capacity(self) -> None:
        with self._lock:
            self._in_system -= 1

    def _release(self, rid: int) -> None:
        r = self._active.pop(rid, None)
        if r is not None:
            self._by_uid.pop(r.handle.uid, None)
        try:
            self._engine.release(rid)
        except Exception:
            log.exception("engine.release(%s) failed", rid)

    def _fail_all(self, error: WorkerError) -> None:
        """Fail every waiting and running request; running ones are aborted in the engine."""
        waiting = list(self._waiting)
        self._waiting.clear()
        for r in waiting:
            self._fail(r, error)
        for rid, r in list(self._active.items()):
            if r.done:
                continue
            self._fail(r, error)
            try:
                self._engine.abort(rid)
            except Exception:
                log.exception("engine.abort failed")
        self._publish_queue_state()

    def _shutdown(self) -> None:
        """Abort whatever is still in flight (the server is going away); calls still queued are cancelled."""
        run_held()
        while not self._inbox.empty():  # what came in meanwhile: requests failed below, calls cancelled
            kind, obj = self._inbox.get_nowait()
            if kind == "add":
                self._add(obj)
            elif kind == "call":
                obj[1].cancel()
        self._fail_all(WorkerError(503, "service_unavailable", SHUTTING_DOWN))
        self._active.clear()
        self._by_uid.clear()
        self._publish_queue_state()
