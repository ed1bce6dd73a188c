"""EventPoster: a worker thread's events reach their event loops in order, each loop woken once per post without
polling, and with polling only when the loop is not already looking (a steady stream: one wake-up in all)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import pytest

from server.handoff import SLOW_GAP_POLLS, EventPoster, LookPace, poll_interval

TIMEOUT_S = 10.0


class CountedWakes:
    """Counts the poster's `call_soon_threadsafe` on a loop (its wake-ups of it; not `asyncio.to_thread`'s)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.count, self._original = loop, 0, loop.call_soon_threadsafe
        loop.call_soon_threadsafe = self._counted  # type: ignore[method-assign]

    def _counted(self, callback: Any, *args: Any, **kwargs: Any) -> Any:
        self.count += getattr(callback, "__name__", "") in ("_deliver", "drain", "deliver")
        return self._original(callback, *args, **kwargs)

    def restore(self) -> None:
        del self.loop.call_soon_threadsafe


async def receive(queue: asyncio.Queue[int], n: int) -> list[int]:
    return [await asyncio.wait_for(queue.get(), TIMEOUT_S) for _ in range(n)]


def post_from_thread(poster: EventPoster, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[int],
                     groups: list[list[int]], pause_s: float = 0.0, wakes: set[int] | None = None) -> threading.Thread:
    """Post each group (one worker step's events) from another thread, `pause_s` apart; the groups whose index is
    in `wakes` ask to wake the loop (all of them when None)."""

    def run() -> None:
        for i, group in enumerate(groups):
            poster.post_all([(loop, queue, event) for event in group], wake=wakes is None or i in wakes)
            time.sleep(pause_s)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_without_polling_each_post_wakes_each_of_its_loops_once() -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        wakes = CountedWakes(loop)
        queue: asyncio.Queue[int] = asyncio.Queue()
        try:
            thread = post_from_thread(EventPoster(None), loop, queue, [[1, 2, 3], [4], [5, 6]])
            got = await receive(queue, 6)
            await asyncio.to_thread(thread.join)
        finally:
            wakes.restore()
        assert got == [1, 2, 3, 4, 5, 6]
        assert wakes.count == 3

    asyncio.run(test())


@pytest.mark.parametrize("last_wakes", [False, True], ids=["polled-to-the-end", "the-last-wakes"])
def test_a_looking_loop_gets_a_steady_stream_without_being_woken_again(last_wakes: bool) -> None:
    """200 steps' events a millisecond or less apart: the first wakes the loop, which then looks for the rest
    itself (idle_s long enough that a loaded machine's pauses do not end the looking); a group that asks to wake
    it (a request's last event) wakes it while it looks, after everything before it."""

    async def test() -> None:
        loop = asyncio.get_running_loop()
        wakes = CountedWakes(loop)
        queue: asyncio.Queue[int] = asyncio.Queue()
        groups = [[2 * i, 2 * i + 1] for i in range(200)]
        try:
            thread = post_from_thread(EventPoster(0.001, idle_s=TIMEOUT_S), loop, queue, groups, pause_s=0.0005,
                                      wakes={0, 199} if last_wakes else {0})
            got = await receive(queue, 400)
            await asyncio.to_thread(thread.join)
        finally:
            wakes.restore()
        assert got == list(range(400))
        assert wakes.count == (2 if last_wakes else 1)

    asyncio.run(test())


def test_a_loop_stops_looking_when_events_stop_and_the_next_post_wakes_it() -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        poster = EventPoster(0.001, idle_s=0.01)
        wakes = CountedWakes(loop)
        queue: asyncio.Queue[int] = asyncio.Queue()
        try:
            await asyncio.to_thread(post_from_thread(poster, loop, queue, [[1]]).join)
            assert await receive(queue, 1) == [1]
            deadline = time.monotonic() + TIMEOUT_S
            while poster._boxes[loop].looking and time.monotonic() < deadline:  # idle: it stops looking
                await asyncio.sleep(0.005)
            assert not poster._boxes[loop].looking
            await asyncio.to_thread(post_from_thread(poster, loop, queue, [[2]]).join)
            assert await receive(queue, 1) == [2]
        finally:
            wakes.restore()
        assert wakes.count == 2

    asyncio.run(test())


@pytest.mark.parametrize("poll_s", [None, 0.001], ids=["woken", "polled"])
def test_events_for_two_loops_reach_each_its_own(poll_s: float | None) -> None:
    """Two loops in two threads (two servers' clients, or a benchmark's), one poster: each gets its own events,
    in order."""
    poster = EventPoster(poll_s)
    ready = threading.Barrier(3)
    results: dict[str, list[int]] = {}
    queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[int]]] = {}

    def serve(name: str) -> None:
        async def main() -> None:
            queues[name] = (asyncio.get_running_loop(), asyncio.Queue())
            await asyncio.to_thread(ready.wait)
            results[name] = await receive(queues[name][1], 20)

        asyncio.run(main())

    threads = [threading.Thread(target=serve, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    ready.wait(TIMEOUT_S)
    for i in range(20):
        poster.post_all([(*queues["a"], i), (*queues["b"], 100 + i)])
    for t in threads:
        t.join(TIMEOUT_S)
    assert results == {"a": list(range(20)), "b": list(range(100, 120))}


def test_a_closed_loop_is_skipped_quietly_and_let_go() -> None:
    """Events for a closed loop are dropped without an error for the worker, and a poster keeps no loop alive (a
    benchmark runs a loop per pass, a server's tests one per test)."""
    poster = EventPoster(0.001)
    for poll_s in (None, 0.001):
        loop = asyncio.new_event_loop()
        loop.close()
        EventPoster(poll_s).post_all([(loop, asyncio.Queue(), 1)])  # nobody listens
    for _ in range(3):
        async def one() -> None:
            queue: asyncio.Queue[int] = asyncio.Queue()
            await asyncio.to_thread(poster.post_all, [(asyncio.get_running_loop(), queue, 1)])
            assert await receive(queue, 1) == [1]

        asyncio.run(one())
    loop = asyncio.new_event_loop()
    poster.post_all([(loop, asyncio.Queue(), 2)])  # a look is due (it never comes: the loop never runs)
    loop.close()
    for i in range(100):  # a stream's tokens for a loop that closed while looking: dropped, not kept
        poster.post_all([(loop, asyncio.Queue(), i)], wake=False)
    assert poster._boxes[loop].items == []
    del loop
    gc.collect()
    assert len(poster._boxes) == 0


def test_a_cpu_worker_polls_and_a_gpu_worker_wakes() -> None:
    assert poll_interval("cpu") is not None
    assert poll_interval("cuda") is None and poll_interval("cuda:1") is None


def test_a_worker_wakes_a_looking_loop_for_a_requests_first_tokens_and_its_end() -> None:
    """A worker whose loops look for events only every 30 s: a stream already running keeps the loop looking, yet a
    second request's first tokens and both requests' ends arrive at once (each wakes the loop); only the tokens in
    between wait for a look."""
    from dflash_core.sampling import SamplingParams
    from server.handoff import RequestHandle
    from server.metrics import ServerMetrics
    from server.worker import Worker
    from tests.fake_engine import FakeEngine, Script, demo_tokenizer

    engine = FakeEngine(tokenizer=demo_tokenizer())
    gates = {key: threading.Event() for key in ("first", "second")}
    for key, gate in gates.items():
        engine.script(key, Script([f"{key} one", gate, " two", " three"]))

    async def test() -> None:
        metrics = ServerMetrics(block_size=engine.block_size, target="fake", draft="fake", device="cpu", backend="fake")
        worker = Worker(engine, demo_tokenizer(), metrics, max_running=2, max_waiting=2, poll_events_s=30.0)
        worker.start()
        loop = asyncio.get_running_loop()

        def handle(key: str) -> RequestHandle:
            ids = demo_tokenizer()(key, add_special_tokens=False)["input_ids"]
            return RequestHandle(index=0, prompt_token_ids=ids, params=SamplingParams(max_tokens=8), loop=loop,
                                 queue=asyncio.Queue(), request_id=key)

        try:
            first, second = handle("first"), handle("second")
            worker.submit([first])
            assert (await asyncio.wait_for(first.queue.get(), TIMEOUT_S)).text == "first one"  # the loop looks now
            worker.submit([second])
            assert (await asyncio.wait_for(second.queue.get(), TIMEOUT_S)).text == "second one"  # not 30 s later
            for key, h in (("first", first), ("second", second)):
                gates[key].set()
                events = [await asyncio.wait_for(h.queue.get(), TIMEOUT_S)]
                while events[-1].finish_reason is None:
                    events.append(await asyncio.wait_for(h.queue.get(), TIMEOUT_S))
                assert "".join(e.text for e in events) == " two three"
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(test())


def test_a_loop_looks_on_until_twice_the_usual_gap_between_steps_has_passed() -> None:
    """Steps 4 ms apart (two polls): an empty look 5 ms after the last events looks again (the next step is due),
    one 9 ms after stops. Steps slower than SLOW_GAP_POLLS polls: the first empty look stops. A pause of seconds
    (an idle server) does not count as a step's gap; `idle_s` keeps a loop looking at least that long."""
    poll = 0.002
    pace = LookPace(poll, idle_s=0.0)
    assert not pace.keep_looking(100.0)  # nothing found yet: the first empty look stops
    for i in range(20):
        pace.found(100.0 + 0.004 * i)
    last = 100.0 + 0.004 * 19
    assert pace.gap == pytest.approx(0.004, rel=0.01)  # a running average, from 0
    assert pace.keep_looking(last + 0.005) and not pace.keep_looking(last + 0.009)

    slow = LookPace(poll, idle_s=0.0)
    step = (SLOW_GAP_POLLS + 1) * poll
    for i in range(20):
        slow.found(200.0 + step * i)
    assert not slow.keep_looking(200.0 + step * 19 + poll)

    paused = LookPace(poll, idle_s=0.0)
    for t in (300.0, 300.004, 305.0, 305.004):
        paused.found(t)
    assert paused.gap < 0.004  # the 5 s pause left the average alone

    idle = LookPace(poll, idle_s=0.010)
    idle.found(400.0)
    assert idle.keep_looking(400.009) and not idle.keep_looking(400.011)
