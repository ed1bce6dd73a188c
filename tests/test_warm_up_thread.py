"""The warm-up runs on the thread that serves (recorded CUDA graphs are per thread): the worker's thread runs
`Engine.warm_up` (the runners' compiled shapes, then the cost measurements) before its first step, and the server
answers not-ready until it has."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from dflash_core.config import EngineConfig
from dflash_core.loading import LoadedModels, load_models
from dflash_core.sampling import SamplingParams
from server.app import create_app
from server.handoff import RequestHandle
from server.metrics import ServerMetrics
from server.settings import Settings
from server.state import ServerState
from server.worker import Worker
from tests.fake_engine import FakeEngine, Script, demo_tokenizer, wait_until
from tests.helpers import make_tiny_pair

T = TypeVar("T")
TEST_TIMEOUT_S = 20.0


def run(test: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(test(), TEST_TIMEOUT_S))


class WarmUpEngine(FakeEngine):
    """A scripted engine whose warm-up waits for a gate (or fails), recording the threads of warm-up and steps."""

    def __init__(self, fail: Exception | None = None, **kwargs: Any) -> None:
        super().__init__(tokenizer=demo_tokenizer(), **kwargs)
        self.gate = threading.Event()
        self.fail = fail
        self.warm_up_threads: list[int] = []
        self.step_threads: set[int] = set()

    def warm_up(self) -> None:
        self.warm_up_threads.append(threading.get_ident())
        assert self.gate.wait(TEST_TIMEOUT_S)
        if self.fail is not None:
            raise self.fail

    def step(self) -> Any:
        self.step_threads.add(threading.get_ident())
        return super().step()


def fake_models(engine: FakeEngine) -> LoadedModels:
    return LoadedModels(engine=engine, tokenizer=demo_tokenizer(), target_name="fake-target",  # type: ignore[arg-type]
                        draft_name=None, device="cpu", dtype="float32", block_size=engine.block_size, backend="fake")


def test_the_server_is_not_ready_until_the_worker_thread_has_warmed_up(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = WarmUpEngine()
    engine.script("hello", Script(["Hi there"]))
    loads: list[tuple[bool, int]] = []

    def fake_load(config: EngineConfig, warm_up: bool = True) -> LoadedModels:
        loads.append((warm_up, threading.get_ident()))
        return fake_models(engine)

    monkeypatch.setattr("server.state.load_models", fake_load)
    app = create_app(Settings(served_model_name="m"))
    body = {"model": "m", "prompt": "hello", "max_tokens": 8}

    async def test() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=TEST_TIMEOUT_S) as client:
                await asyncio.to_thread(wait_until, lambda: bool(engine.warm_up_threads), what="the warm-up")
                health = await client.get("/health")
                assert health.status_code == 503 and health.json()["status"] == "loading"
                assert (await client.post("/v1/completions", json=body)).status_code == 503
                engine.gate.set()
                await asyncio.to_thread(wait_until, lambda: app.state.dflash.ready, what="ready")
                assert (await client.get("/health")).status_code == 200
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hi there"

    run(test)
    assert loads and loads[0][0] is False  # the loading thread does not warm the runners up
    assert engine.warm_up_threads and engine.step_threads == set(engine.warm_up_threads)
    assert loads[0][1] not in engine.step_threads


def test_a_failed_warm_up_is_a_load_error(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = WarmUpEngine(fail=RuntimeError("graph capture failed"))
    engine.gate.set()
    monkeypatch.setattr("server.state.load_models", lambda config, warm_up=True: fake_models(engine))
    errors: list[str] = []
    state = ServerState(Settings())
    state.load(errors.append)
    wait_until(lambda: bool(errors), what="the error")
    assert "graph capture failed" in errors[0] and state.load_error == errors[0]
    assert state.worker is not None
    wait_until(lambda: not state.worker.is_alive(), what="the worker to end")  # type: ignore[union-attr]
    assert not state.ready
    asyncio.run(state.chat_setup.close())  # type: ignore[union-attr]


def test_a_real_engine_warms_its_runners_up_on_the_thread_that_runs_its_steps(tmp_path: Path) -> None:
    """`Engine.warm_up` on the worker: the runners' compile warm-up and the warm-up forwards run on the worker's
    thread, the same thread as a served request's forwards."""
    target_dir, draft_dir = make_tiny_pair(tmp_path, arch="llama", block_size=4)
    models = load_models(EngineConfig(str(target_dir), str(draft_dir), backend="native", device="cpu",
                                      max_running_requests=2), warm_up=False)
    engine = models.engine
    threads: dict[str, set[int]] = {"target.warm_up": set(), "drafter.warm_up": set(), "forward": set()}

    def recorded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            threads[name].add(threading.get_ident())
            return fn(*args, **kwargs)
        return call

    engine.target.warm_up = recorded("target.warm_up", engine.target.warm_up)  # type: ignore[method-assign]
    engine.drafter.warm_up = recorded("drafter.warm_up", engine.drafter.warm_up)  # type: ignore[method-assign,union-attr]
    engine.target.forward_batch = recorded("forward", engine.target.forward_batch)  # type: ignore[method-assign]
    metrics = ServerMetrics(block_size=engine.block_size, target="t", draft="d", device="cpu", backend="native")
    worker = Worker(engine, models.tokenizer, metrics, max_running=2, max_waiting=2, warm_up=engine.warm_up)
    assert not worker.ready
    worker.start()
    try:
        wait_until(lambda: worker.ready, timeout=TEST_TIMEOUT_S, what="the warm-up")
        assert engine.policy.costs.target.ready  # the warm-up measured the costs
        warm = set(threads["forward"])
        assert threads["target.warm_up"] == threads["drafter.warm_up"] == warm and len(warm) == 1
        assert threading.get_ident() not in warm

        async def serve() -> None:
            h = RequestHandle(index=0, prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=6),
                              loop=asyncio.get_running_loop(), queue=asyncio.Queue())
            worker.submit([h])
            while (await h.queue.get()).finish_reason is None:
                pass

        threads["forward"].clear()
        run(serve)
        assert threads["forward"] == warm  # the served request's forwards: the warm-up's thread
    finally:
        worker.stop()
