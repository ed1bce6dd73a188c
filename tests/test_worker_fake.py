"""The worker thread against a scripted engine: admission, queueing, abort, stop strings split across steps,
per-request and whole-step engine failures, fail_all / stop, and the speculative summary; each with a step's
events posted when it ends, held for the next step's wait for the device (`hold_events`), and held and looked for
by the event loop itself (`poll_events_s`, as on a CPU)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest

from dflash_core.sampling import SamplingParams
from server.handoff import RequestHandle, WorkerEvent
from server.metrics import ServerMetrics
from server.worker import QueueFullError, Worker
from tests.fake_engine import Fail, FakeEngine, Script, demo_tokenizer, wait_until

T = TypeVar("T")
TEST_TIMEOUT_S = 10.0
MODE = {"hold": False, "poll": None}  # the worker's `hold_events` and `poll_events_s` in this test (each test runs
# every way)


@pytest.fixture(autouse=True, params=[(False, None), (True, None), (True, 0.001)],
                ids=["posted-at-once", "held-for-the-next-step", "held-and-polled"])
def _event_mode(request: pytest.FixtureRequest) -> None:
    MODE["hold"], MODE["poll"] = request.param


def run(test: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(test(), TEST_TIMEOUT_S))


@asynccontextmanager
async def serving(engine: FakeEngine, max_running: int = 2, max_waiting: int = 4) -> AsyncIterator[Worker]:
    metrics = ServerMetrics(block_size=engine.block_size, target="fake", draft="fake", device="cpu", backend="fake")
    worker = Worker(engine, demo_tokenizer(), metrics, max_running=max_running, max_waiting=max_waiting,
                    hold_events=MODE["hold"], poll_events_s=MODE["poll"])
    worker.start()
    try:
        yield worker
    finally:
        await asyncio.to_thread(worker.stop)


def handle(prompt: str, stop: list[str] | None = None, max_tokens: int = 64, index: int = 0) -> RequestHandle:
    """One engine request whose prompt is ``prompt`` (the fake engine picks its script by that text)."""
    ids = demo_tokenizer()(prompt, add_special_tokens=False)["input_ids"]
    return RequestHandle(
        index=index,
        prompt_token_ids=ids,
        params=SamplingParams(max_tokens=max_tokens, stop=stop or []),
        loop=asyncio.get_running_loop(),
        queue=asyncio.Queue(),
        request_id=f"test-{prompt}",
    )


async def events(h: RequestHandle) -> list[WorkerEvent]:
    """Every event of ``h`` up to its last one."""
    out: list[WorkerEvent] = []
    while not out or out[-1].finish_reason is None:
        out.append(await h.queue.get())
    return out


def text(evs: list[WorkerEvent]) -> str:
    return "".join(ev.text for ev in evs)


async def until(predicate: Callable[[], bool], what: str) -> None:
    await asyncio.to_thread(wait_until, predicate, what=what)


def new_engine(**kwargs: Any) -> FakeEngine:
    return FakeEngine(tokenizer=demo_tokenizer(), **kwargs)


def test_admits_up_to_max_running_queues_the_rest_and_refuses_beyond() -> None:
    engine, gate = new_engine(), threading.Event()
    for key in ("one", "two", "three"):
        engine.script(key, Script([gate, f"{key} done"]))

    async def test() -> None:
        async with serving(engine, max_running=2, max_waiting=1) as worker:
            hs = [handle(k) for k in ("one", "two", "three")]
            for h in hs:
                worker.submit([h])
            await until(lambda: engine.num_running() == 2 and worker.num_waiting == 1, "2 running, 1 waiting")
            assert worker.in_flight == 3
            with pytest.raises(QueueFullError):
                worker.submit([handle("four")])
            gate.set()
            results = [await events(h) for h in hs]
            assert [text(r) for r in results] == ["one done", "two done", "three done"]
            assert [r[-1].finish_reason for r in results] == ["length"] * 3
            assert worker.in_flight == 0 and len(engine.added) == 3
            worker.submit([handle("four")])  # room again

    run(test)


def test_all_or_none_submission() -> None:
    async def test() -> None:
        async with serving(new_engine(), max_running=1, max_waiting=1) as worker:
            with pytest.raises(QueueFullError):
                worker.submit([handle("a", index=i) for i in range(3)])
            assert worker.in_flight == 0

    run(test)


def test_abort_frees_the_slot_for_the_next_request_at_once() -> None:
    engine = new_engine()
    engine.script("held", Script(["first", threading.Event(), "never"]))
    engine.script("queued", Script(["next"]))

    async def test() -> None:
        async with serving(engine, max_running=1, max_waiting=2) as worker:
            held, queued, gone = handle("held"), handle("queued"), handle("gone")
            worker.submit([held])
            assert (await held.queue.get()).text == "first"
            worker.submit([queued])
            worker.submit([gone])
            await until(lambda: worker.num_waiting == 2, "two waiting")
            worker.abort(gone)  # waiting: never reaches the engine
            assert (await events(gone))[-1].finish_reason == "abort"
            worker.abort(held)
            assert (await events(held))[-1].finish_reason == "abort"
            assert text(await events(queued)) == "next"
            rid = engine.request_id("held")
            assert rid in engine.aborted and rid in engine.released
            assert len(engine.added) == 2 and worker.in_flight == 0

    run(test)


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        (["Hello E", "ND tail", "never"], "Hello "),  # "E" then "ND"
        (["Hello EN", "D", "never"], "Hello "),
        (["Hello E", "Nope END"], "Hello ENope "),  # a partial match that fails, then a real one
    ],
)
def test_stop_string_split_across_steps_is_cut(steps: list[str], expected: str) -> None:
    engine = new_engine()
    engine.script("stopper", Script(list(steps)))

    async def test() -> None:
        async with serving(engine) as worker:
            h = handle("stopper", stop=["END"])
            worker.submit([h])
            evs = await events(h)
            assert text(evs) == expected
            assert evs[-1].finish_reason == "stop" and evs[-1].error is None
            assert "never" not in text(evs)
            rid = engine.request_id("stopper")
            await until(lambda: rid in engine.released, "the stopped request released")

    run(test)


def test_eos_token_ends_with_stop_and_is_not_text() -> None:
    tok = demo_tokenizer()
    engine = new_engine()
    engine.script("eos", Script(["bye"], stop_token_id=tok.eos_token_id))

    async def test() -> None:
        async with serving(engine) as worker:
            h = handle("eos")
            worker.submit([h])
            evs = await events(h)
            assert text(evs) == "bye" and evs[-1].finish_reason == "stop"
            assert evs[-1].completion_tokens == len(tok("bye", add_special_tokens=False)["input_ids"]) + 1

    run(test)


def test_an_engine_error_fails_its_request_and_no_other() -> None:
    engine, gate = new_engine(), threading.Event()
    engine.script("bad", Script(["partial", gate, Fail("kaput")]))
    engine.script("good", Script(["all", gate, " fine"]))

    async def test() -> None:
        async with serving(engine) as worker:
            bad, good = handle("bad"), handle("good")
            worker.submit([bad])
            worker.submit([good])
            await until(lambda: engine.num_running() == 2, "both running")
            gate.set()
            bad_evs, good_evs = await events(bad), await events(good)
            error = bad_evs[-1].error
            assert error is not None and (error.status, error.type) == (500, "server_error")
            assert "kaput" in error.message and text(bad_evs) == "partial"
            assert text(good_evs) == "all fine" and good_evs[-1].finish_reason == "length"

    run(test)


def test_a_failed_step_fails_the_running_requests_and_the_worker_goes_on() -> None:
    engine, gate = new_engine(), threading.Event()
    engine.script("victim", Script([gate, "never"]))

    async def test() -> None:
        async with serving(engine) as worker:
            victim = handle("victim")
            worker.submit([victim])
            await until(lambda: engine.num_running() == 1, "running")
            engine.fail_next_step(RuntimeError("the GPU caught fire"))
            error = (await events(victim))[-1].error
            assert error is not None and error.status == 500 and "GPU caught fire" in error.message
            after = handle("after")
            worker.submit([after])
            assert text(await events(after)) == "ok"

    run(test)


def test_a_refused_request_is_a_400() -> None:
    engine = new_engine()
    engine.refuse("nope", "too silly")

    async def test() -> None:
        async with serving(engine) as worker:
            h = handle("nope")
            worker.submit([h])
            (ev,) = await events(h)
            assert ev.error is not None and (ev.error.status, ev.error.type) == (400, "invalid_request_error")
            assert ev.error.message == "too silly" and worker.in_flight == 0

    run(test)


def test_fail_all_answers_running_and_waiting_requests_with_503() -> None:
    engine = new_engine()
    engine.script("running", Script(["some", threading.Event()]))

    async def test() -> None:
        async with serving(engine, max_running=1, max_waiting=2) as worker:
            running, waiting = handle("running"), handle("waiting")
            worker.submit([running])
            assert (await running.queue.get()).text == "some"
            worker.submit([waiting])
            await until(lambda: worker.num_waiting == 1, "one waiting")
            worker.fail_all()
            for h in (running, waiting):
                (ev,) = await events(h)  # the running one's tokens came before; the waiting one gets only this
                assert ev.error is not None and (ev.error.status, ev.error.type) == (503, "service_unavailable")
            later = handle("later")
            worker.submit([later])  # after fail_all: answered at once
            (ev,) = await events(later)
            assert ev.error is not None and ev.error.status == 503
            assert engine.request_id("running") in engine.aborted and len(engine.added) == 1

    run(test)


def test_stop_ends_requests_in_flight_with_503() -> None:
    engine = new_engine()
    engine.script("held", Script([threading.Event()]))

    async def test() -> None:
        async with serving(engine, max_running=1) as worker:
            held, waiting = handle("held"), handle("waiting")
            worker.submit([held])
            worker.submit([waiting])
            await until(lambda: engine.num_running() == 1 and worker.num_waiting == 1, "1 running, 1 waiting")
            await asyncio.to_thread(worker.stop)
            for h in (held, waiting):
                (ev,) = await events(h)
                assert ev.error is not None and ev.error.status == 503

    run(test)


def test_the_speculative_summary_is_the_engines() -> None:
    engine = new_engine(block_size=4)
    engine.script("spec", Script([[10], [11, 12, 13], [14], [15, 16]]))  # accepted 2, 0, 1 of 3 drafts

    async def test() -> None:
        async with serving(engine) as worker:
            h = handle("spec")
            worker.submit([h])
            last = (await events(h))[-1]
            rid = engine.request_id("spec")
            await until(lambda: rid in engine.released, "released")
            stats = engine.final_stats[rid]
            assert last.spec == stats.summary()
            assert last.spec is not None and (last.spec.num_drafts, last.spec.num_accepted_tokens) == (3, 3)
            assert last.spec.mean_acceptance_length == stats.mean_acceptance_length == 2.0
            assert last.completion_tokens == 7

    run(test)


def test_a_step_of_several_streams_wakes_the_event_loop_once() -> None:
    """Every event of one step reaches the event loop in one hand-off, in order per request."""
    engine, gate = new_engine(), threading.Event()
    keys = ("red", "green", "blue")
    for key in keys:
        engine.script(key, Script([gate, f"{key} one", " two", " three"]))

    async def test() -> None:
        loop = asyncio.get_running_loop()
        handoffs: list[int] = []  # events per wake-up by `_deliver`; 0 for a polling loop's (`drain`, `deliver`)
        original = loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
            if callback.__name__ in ("_deliver", "drain", "deliver"):  # not asyncio.to_thread's
                handoffs.append(len(args[0]) if args else 0)
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        try:
            async with serving(engine, max_running=3, max_waiting=1) as worker:
                hs = [handle(k, index=i) for i, k in enumerate(keys)]
                worker.submit(hs)
                await until(lambda: len(engine.added) == 3, "all three admitted")
                with engine._lock:  # between two steps: every request's next step is the same one
                    gate.set()
                texts = [text(await events(h)) for h in hs]
        finally:
            del loop.call_soon_threadsafe
        assert texts == [f"{k} one two three" for k in keys]
        if MODE["poll"] is None:  # three steps of three events each: three hand-offs of three events (not nine of one)
            assert sorted(handoffs) == [3, 3, 3], handoffs
        else:  # the loop looks for them itself: woken once per step at most (first tokens, the end, or after idling)
            assert 1 <= len(handoffs) <= 3 and not any(handoffs), handoffs

    run(test)


def test_a_call_between_steps_runs_on_the_worker_thread_and_a_stopped_worker_cancels_it() -> None:
    """`between_steps` (a draft swap): the function runs on the worker's thread, between two steps of a running
    stream, which goes on; its error reaches the caller; after the worker has stopped a call is cancelled, never
    left waiting."""
    engine = new_engine()
    engine.script("long", Script(["a", "b", "c", "d", "e", "f"]))

    async def test() -> None:
        async with serving(engine) as worker:
            h = handle("long")
            worker.submit([h])
            await until(lambda: engine.steps >= 2, "two steps")
            seen: list[int] = []
            done = worker.between_steps(lambda: seen.append(threading.get_native_id()) or 7)
            assert await asyncio.wrap_future(done) == 7
            assert seen == [worker.thread_id]
            failing = worker.between_steps(lambda: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                await asyncio.wrap_future(failing)
            assert text(await events(h)) == "abcdef"
        late = worker.between_steps(lambda: 1)
        assert late.cancelled()

    run(test)


class PausingEngine(FakeEngine):
    """A scripted engine whose first step that commits tokens ends only once `resume` is set (`paused` tells it
    is there): what the test queues meanwhile meets that step's events still held."""

    def __init__(self) -> None:
        super().__init__(tokenizer=demo_tokenizer())
        self.paused, self.resume = threading.Event(), threading.Event()

    def step(self) -> list[Any]:
        outs = super().step()
        if outs and not self.resume.is_set():
            self.paused.set()
            self.resume.wait(TEST_TIMEOUT_S)
        return outs


async def paused_after_some(worker: Worker, engine: PausingEngine) -> RequestHandle:
    """A request submitted and stepped until its step that committed "some" is paused at its end."""
    engine.script("paused", Script(["some", threading.Event()]))
    h = handle("paused")
    worker.submit([h])
    await asyncio.to_thread(engine.paused.wait, TEST_TIMEOUT_S)
    return h


def test_an_event_posted_between_steps_comes_after_the_tokens_of_the_step_before() -> None:
    """fail_all lands right after a step that committed tokens (held, with `hold_events`, for the next step's
    wait): the stream still gets its tokens first, then the error."""
    engine = PausingEngine()

    async def test() -> None:
        async with serving(engine) as worker:
            h = await paused_after_some(worker, engine)
            worker.fail_all()
            engine.resume.set()
            evs = await events(h)
            assert [ev.text for ev in evs] == ["some", ""] and evs[-1].error is not None

    run(test)


def test_a_call_between_steps_runs_after_the_last_steps_events_are_posted() -> None:
    """A call between steps (a draft swap, which may take seconds) comes right after a step that committed tokens:
    the stream's tokens are on their way before it runs."""
    engine = PausingEngine()

    async def test() -> None:
        async with serving(engine) as worker:
            h = await paused_after_some(worker, engine)
            done = worker.between_steps(lambda: wait_until(lambda: not h.queue.empty(), 5.0, "the posted tokens"))
            engine.resume.set()
            await asyncio.wrap_future(done)  # the call saw the tokens delivered (else it raised)
            assert (await h.queue.get()).text == "some"
            worker.abort(h)

    run(test)
