"""SIGTERM drains: real ``python -m server`` processes on 127.0.0.1 whose engine a test gate holds still.

The gate (tests/engine_gate.py) lets the engine run a given number of steps and then pauses it, so a stream is
"still running" or a request "still queued" for as long as a test needs, with no timing assumptions.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine_gate import BOUND_S, Stream, chat, open_gate, set_gate, start_gated_server
from tests.server_fixtures import SERVED_NAME, ServerProcess, make_scripted_pair

POLL_S = 0.02


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scripted_pair(tmp_path_factory.mktemp("shutdown"))[0]


def start(target: Path, tmp_path: Path, shutdown_timeout: float, gate_steps: int) -> tuple[ServerProcess, Path]:
    """A plain (autoregressive) server, one running request at most, its engine gated after ``gate_steps``."""
    gate = tmp_path / "gate"
    set_gate(gate, gate_steps)
    args = [
        "--target", str(target), "--no-speculative", "--device", "cpu", "--served-model-name", SERVED_NAME,
        "--max-running-requests", "1", "--max-waiting-requests", "4",
        "--shutdown-timeout", str(shutdown_timeout),
    ]  # fmt: skip
    server = start_gated_server(args, tmp_path / "server.log", gate)
    server.wait_ready()
    return server, gate


class Call(threading.Thread):
    """A request in the background: its status, headers and JSON body."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: httpx.Response | None = None

    def run(self) -> None:
        self.response = httpx.post(f"{self.url}/v1/chat/completions", json=self.body, timeout=BOUND_S)


def wait_for(what: str, check: Callable[[], bool], server: ServerProcess) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{server.log_tail()}"
        time.sleep(POLL_S)


def health(server: ServerProcess) -> tuple[int, dict[str, Any]]:
    r = httpx.get(f"{server.url}/health", timeout=10)
    return r.status_code, r.json()


def finish_reasons(events: list[Any]) -> list[str | None]:
    return [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices")]


def test_running_stream_finishes_after_sigterm_and_new_requests_get_503(target: Path, tmp_path: Path) -> None:
    server, gate = start(target, tmp_path, shutdown_timeout=300, gate_steps=3)
    try:
        stream = Stream(server.url, max_tokens=60)
        stream.start()
        assert stream.first.wait(BOUND_S) and stream.error is None, server.log_tail()
        wait_for("the stream to run", lambda: health(server)[1].get("running") == 1, server)

        server.proc.send_signal(signal.SIGTERM)
        wait_for("/health to say draining", lambda: health(server) == (503, {"status": "draining"}), server)
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=chat(False, 5), timeout=BOUND_S)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "shutting_down"
        assert stream.is_alive() and server.proc.poll() is None  # the stream is held, so is the process

        open_gate(gate)  # the stream runs to its end within the shutdown timeout
        stream.join(BOUND_S)
        assert not stream.is_alive() and stream.error is None, server.log_tail()
        assert stream.events[-1] == "[DONE]"
        assert finish_reasons(stream.events)[-1] == "length"
        assert not any("error" in e for e in stream.events[:-1])
        assert server.proc.wait(timeout=BOUND_S) == 0, server.log_tail()
    finally:
        server.terminate()


def test_after_the_shutdown_timeout_streams_get_an_error_event_and_queued_requests_a_503(
    target: Path, tmp_path: Path
) -> None:
    server, _ = start(target, tmp_path, shutdown_timeout=0.5, gate_steps=3)
    try:
        stream = Stream(server.url, max_tokens=500)
        stream.start()
        assert stream.first.wait(BOUND_S) and stream.error is None, server.log_tail()
        queued_stream = Stream(server.url, max_tokens=5)
        queued = Call(server.url, chat(False, 5))
        queued_stream.start()
        queued.start()
        wait_for("two queued requests", lambda: health(server)[1].get("waiting") == 2, server)

        server.proc.send_signal(signal.SIGTERM)  # the engine stays paused: nothing can finish by itself
        for t in (stream, queued_stream, queued):
            t.join(BOUND_S)
            assert not t.is_alive(), server.log_tail()

        assert stream.error is None and stream.status == 200, server.log_tail()
        *chunks, error_event, done = stream.events
        assert done == "[DONE]", stream.events
        assert chunks and all("choices" in c for c in chunks)  # the tokens it had, then
        assert error_event["error"]["type"] == "service_unavailable", error_event
        assert "shutting down" in error_event["error"]["message"]

        if queued_stream.status == 200:  # it had sent its headers while queued: an error event, then [DONE]
            error_event, done = queued_stream.events
            assert done == "[DONE]" and error_event["error"]["type"] == "service_unavailable", queued_stream.events
        else:  # a 503 envelope, not an SSE stream
            assert queued_stream.status == 503 and queued_stream.events == [], queued_stream.events
        assert queued.response is not None and queued.response.status_code == 503
        assert queued.response.headers["content-type"].startswith("application/json")
        assert queued.response.json()["error"]["type"] == "service_unavailable"
        assert server.proc.wait(timeout=BOUND_S) == 0, server.log_tail()
    finally:
        server.terminate()
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


def test_a_second_signal_exits_at_once(target: Path, tmp_path: Path) -> None:
    server, _ = start(target, tmp_path, shutdown_timeout=3600, gate_steps=3)
    try:
        stream = Stream(server.url, max_tokens=500)
        stream.start()
        assert stream.first.wait(BOUND_S) and stream.error is None, server.log_tail()
        server.proc.send_signal(signal.SIGTERM)
        wait_for("/health to say draining", lambda: health(server)[0] == 503, server)
        server.proc.send_signal(signal.SIGINT)  # the stream would hold the drain for an hour
        assert server.proc.wait(timeout=BOUND_S) == 128 + signal.SIGINT, server.log_tail()
    finally:
        server.terminate()
    assert "SIGINT: exiting now" in server.log_tail()
