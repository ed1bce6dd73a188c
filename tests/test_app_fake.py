"""The app in-process with a scripted engine (no model, no subprocess, no socket): response shapes, 429 when the
queue is full, disconnects that free their slot, stop strings split across steps, one request's engine error,
the drain path (503s and error events), and the request checks."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
import pytest
from fastapi import FastAPI

import server.streaming as server_streaming
from dflash_core.loading import LoadedModels
from server.app import create_app
from server.settings import Settings
from server.state import ServerState
from tests.fake_engine import Fail, FakeEngine, Script, demo_tokenizer, wait_until

T = TypeVar("T")
MODEL = "fake"
TEST_TIMEOUT_S = 10.0
ENVELOPE_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module", autouse=True)
def _tokenizer() -> None:
    demo_tokenizer()  # loaded once, outside the tests' own time


def run(test: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(test(), TEST_TIMEOUT_S))


def make_app(engine: FakeEngine, **settings: Any) -> FastAPI:
    models = LoadedModels(
        engine=engine,  # type: ignore[arg-type]  # the worker's ServingEngine interface
        tokenizer=demo_tokenizer(),
        target_name="fake-target",
        draft_name="fake-draft",
        device="cpu",
        dtype="float32",
        block_size=engine.block_size,
        backend="fake",
    )
    return create_app(Settings(served_model_name=MODEL, **settings), models=models)


def app_state(app: FastAPI) -> ServerState:
    state = app.state.dflash
    assert isinstance(state, ServerState)
    return state


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan (it installs the models and starts the worker) and a client for it."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake", timeout=TEST_TIMEOUT_S) as client:
            yield client


def new_engine(**kwargs: Any) -> FakeEngine:
    return FakeEngine(tokenizer=demo_tokenizer(), **kwargs)


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 32, **extra}


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 32, **extra}


def sse_data(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (comments skipped)."""
    return [line[len("data: ") :] for line in body.splitlines() if line.startswith("data: ")]


def stream_chunks(body: str) -> list[dict[str, Any]]:
    """The JSON events of a finished stream (which must end with ``[DONE]``)."""
    data = sse_data(body)
    assert data[-1] == "[DONE]", data
    return [json.loads(d) for d in data[:-1]]


def chunk_text(chunk: dict[str, Any]) -> str:
    choice = chunk["choices"][0]
    return choice["delta"].get("content", "") if "delta" in choice else choice["text"]


def envelope(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE_KEYS, body
    return body["error"]


async def until(predicate: Callable[[], bool], what: str) -> None:
    await asyncio.to_thread(wait_until, predicate, what=what)


class AsgiCall:
    """One POST driven straight through the ASGI app: the response read as it comes, a disconnect on demand."""

    def __init__(self, app: FastAPI, path: str, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
            "client": ("127.0.0.1", 1234),
            "server": ("fake", 80),
        }
        self._body: bytes | None = raw
        self._gone = asyncio.Event()
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._buffer = ""
        self.task = asyncio.create_task(app(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()  # from now on every receive answers the disconnect, as servers do
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        await self.messages.put(message)

    async def status(self) -> int:
        message = await self.messages.get()
        assert message["type"] == "http.response.start", message
        return int(message["status"])

    async def next_data(self) -> str:
        """The next ``data:`` payload of the stream (comments skipped)."""
        while True:
            while "\n\n" in self._buffer:
                event, self._buffer = self._buffer.split("\n\n", 1)
                if event.startswith("data: "):
                    return event[len("data: ") :]
            message = await self.messages.get()
            self._buffer += message.get("body", b"").decode()

    def disconnect(self) -> None:
        self._gone.set()


# --- shapes ----------------------------------------------------------------------------------------------------


def test_chat_and_completion_responses_and_streams() -> None:
    engine = new_engine()
    engine.script("greet", Script(["Hello", " world"]))
    app = make_app(engine)

    async def test() -> None:
        async with serving(app) as client:
            r = await client.post("/v1/chat/completions", json=chat("greet"))
            body = r.json()
            assert r.status_code == 200 and body["object"] == "chat.completion" and body["model"] == MODEL
            assert body["choices"] == [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello world"},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ]
            assert body["usage"]["completion_tokens"] == engine.emitted[engine.request_id("greet")]
            assert body["dflash"]["num_drafts"] == 1

            r = await client.post("/v1/completions", json=completion("greet"))
            body = r.json()
            assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello world"

            streamed = chat("greet", stream=True, stream_options={"include_usage": True})
            r = await client.post("/v1/chat/completions", json=streamed)
            chunks = stream_chunks(r.text)
            assert r.headers["content-type"].startswith("text/event-stream")
            assert chunks[0]["object"] == "chat.completion.chunk"
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert "".join(chunk_text(c) for c in chunks[:-1]) == "Hello world"
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0

            r = await client.post("/v1/completions", json=completion("greet", stream=True))
            chunks = stream_chunks(r.text)
            assert all(c["object"] == "text_completion" for c in chunks)
            assert "".join(chunk_text(c) for c in chunks) == "Hello world"

    run(test)


# --- admission -------------------------------------------------------------------------------------------------


def test_a_full_queue_is_429_with_retry_after() -> None:
    engine, gate = new_engine(), threading.Event()
    engine.script("hold", Script([gate, "done"]))
    app = make_app(engine, max_running_requests=1, max_waiting_requests=0)

    async def test() -> None:
        async with serving(app) as client:
            held = asyncio.create_task(client.post("/v1/completions", json=completion("hold")))
            await until(lambda: engine.num_running() == 1, "the first request running")
            r = await client.post("/v1/completions", json=completion("other"))
            error = envelope(r, 429)
            assert r.headers["retry-after"] == "1"
            assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
            gate.set()
            r = await held
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "done"

    run(test)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot_at_once(stream: bool) -> None:
    engine = new_engine()
    engine.script("held", Script(["first", threading.Event()]))  # never finishes by itself
    engine.script("next", Script(["second"]))
    app = make_app(engine, max_running_requests=1, max_waiting_requests=1)

    async def test() -> None:
        async with serving(app) as client:
            call = AsgiCall(app, "/v1/completions", completion("held", stream=stream))
            await until(lambda: engine.emitted.get(0, 0) > 0, "the first tokens")
            if stream:
                assert await call.status() == 200
                assert json.loads(await call.next_data())["choices"][0]["text"] == "first"
            queued = asyncio.create_task(client.post("/v1/completions", json=completion("next")))
            worker = app_state(app).worker
            assert worker is not None
            await until(lambda: worker.num_waiting == 1, "the second request waiting")
            call.disconnect()
            r = await queued
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "second"
            assert engine.request_id("held") in engine.aborted
            await asyncio.wait_for(call.task, TEST_TIMEOUT_S)

    run(test)


# --- stop strings --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_stop_string_split_across_two_steps_is_cut(route: str, stream: bool) -> None:
    engine = new_engine()
    engine.script("stopper", Script(["Hello E", "ND tail", "never"]))  # "END" arrives as "E" then "ND"
    app = make_app(engine)
    make = chat if route == "/v1/chat/completions" else completion
    body = make("stopper", stop=["END"], stream=stream)

    async def test() -> None:
        async with serving(app) as client:
            r = await client.post(route, json=body)
            assert r.status_code == 200, r.text
            if stream:
                chunks = stream_chunks(r.text)
                text = "".join(chunk_text(c) for c in chunks)
                finish = chunks[-1]["choices"][0]["finish_reason"]
            else:
                choice = r.json()["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                finish = choice["finish_reason"]
            assert (text, finish) == ("Hello ", "stop")

    run(test)


# --- errors ----------------------------------------------------------------------------------------------------


def test_an_engine_error_answers_its_request_while_another_completes() -> None:
    engine, gate = new_engine(), threading.Event()
    engine.script("bad plain", Script(["partial", gate, Fail("kaput: /secret/path.py")]))
    engine.script("bad stream", Script(["partial", gate, Fail("kaput: /secret/path.py")]))
    engine.script("good", Script(["fine", gate, " too"]))
    app = make_app(engine, max_running_requests=3)

    async def test() -> None:
        async with serving(app) as client:
            plain = asyncio.create_task(client.post("/v1/completions", json=completion("bad plain")))
            stream = asyncio.create_task(client.post("/v1/completions", json=completion("bad stream", stream=True)))
            good = asyncio.create_task(client.post("/v1/completions", json=completion("good", stream=True)))
            await until(lambda: len(engine.emitted) == 3 and all(engine.emitted.values()), "three started")
            gate.set()

            r = await plain
            error = envelope(r, 500)
            assert error["type"] == "server_error" and "internal server error (request id" in error["message"]
            assert "secret" not in r.text and r.headers["x-request-id"] in error["message"]

            r = await stream
            assert r.status_code == 200
            chunks = stream_chunks(r.text)
            assert chunk_text(chunks[0]) == "partial"
            assert set(chunks[-1]) == {"error"} and set(chunks[-1]["error"]) == ENVELOPE_KEYS
            assert chunks[-1]["error"]["type"] == "server_error" and "secret" not in r.text

            r = await good
            assert "".join(chunk_text(c) for c in stream_chunks(r.text)) == "fine too"

    run(test)


@pytest.mark.parametrize("stream", [True, False])
def test_an_engine_refusal_is_a_400(stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_streaming, "STREAM_HEADERS_GRACE_S", TEST_TIMEOUT_S)  # however slow the machine
    engine = new_engine()
    engine.refuse("nope", "the engine refuses this request")
    app = make_app(engine)

    async def test() -> None:
        async with serving(app) as client:
            r = await client.post("/v1/completions", json=completion("nope", stream=stream))
            error = envelope(r, 400)
            assert (error["type"], error["message"]) == ("invalid_request_error", "the engine refuses this request")

    run(test)


def test_draining_refuses_new_requests_and_fail_all_ends_the_others() -> None:
    engine = new_engine()
    engine.script("streaming", Script(["some", threading.Event()]))
    app = make_app(engine, max_running_requests=1, max_waiting_requests=2)

    async def test() -> None:
        async with serving(app) as client:
            state = app_state(app)
            worker = state.worker
            assert worker is not None
            stream = asyncio.create_task(client.post("/v1/completions", json=completion("streaming", stream=True)))
            await until(lambda: engine.emitted.get(0, 0) > 0, "the stream's first tokens")
            queued = asyncio.create_task(client.post("/v1/completions", json=completion("queued")))
            await until(lambda: worker.num_waiting == 1, "one request waiting")

            state.draining = True  # what server.__main__ does on SIGTERM
            r = await client.post("/v1/completions", json=completion("late"))
            assert envelope(r, 503)["code"] == "shutting_down" and r.headers["retry-after"] == "1"
            health = await client.get("/health")
            assert (health.status_code, health.json()) == (503, {"status": "draining"})

            worker.fail_all()  # the drain's end: the shutdown timeout has passed
            error = envelope(await queued, 503)
            assert (error["type"], error["message"]) == ("service_unavailable", "server is shutting down")
            r = await stream
            chunks = stream_chunks(r.text)
            assert chunk_text(chunks[0]) == "some"
            assert chunks[-1]["error"]["type"] == "service_unavailable"

    run(test)


# --- checks ----------------------------------------------------------------------------------------------------


def test_request_checks() -> None:
    app = make_app(new_engine(), api_key="sesame")
    auth = {"Authorization": "Bearer sesame"}

    async def test() -> None:
        async with serving(app) as client:
            r = await client.post("/v1/completions", json=completion("hi"))
            assert envelope(r, 401)["code"] == "invalid_api_key"
            r = await client.post("/v1/completions", json={**completion("hi"), "model": "other"}, headers=auth)
            assert envelope(r, 404)["code"] == "model_not_found"
            r = await client.post("/v1/completions", content=b"prompt=hi", headers=auth)
            assert envelope(r, 415)["code"] == "unsupported_media_type"
            r = await client.get("/v1/models", headers=auth)
            assert r.json()["data"][0]["id"] == MODEL
            r = await client.post("/v1/completions", json=completion("hi"), headers=auth)
            assert r.json()["choices"][0]["text"] == "ok"

    run(test)


@pytest.mark.parametrize("depth", [100, 900, 1000, 5000])
def test_deeply_nested_tool_call_arguments_are_never_a_500(depth: int) -> None:
    """An earlier assistant call's `arguments` nested past the JSON parser's depth: kept as the client's text (200),
    or refused with a 400 envelope, never a 500."""
    app = make_app(new_engine())
    nested = '{"a":' * depth + "1" + "}" * depth
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": nested}}
    body = {"model": MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "user", "content": "y"}]}

    async def test() -> None:
        async with serving(app) as client:
            r = await client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                envelope(r, 400)
            r = await client.post("/v1/chat/completions", json=chat("hi"))
            assert r.status_code == 200

    run(test)
