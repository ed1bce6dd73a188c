"""Connection limits on a real ``python -m server`` on 127.0.0.1: a fast 503 beyond ``--limit-concurrency``,
idle and slow-header connections closed after ``--header-timeout`` (never a request in progress), keep-alive
connections closed after ``--keep-alive-timeout``, requests admitted again once the connections are gone, and
``GET /health`` never refused (a liveness probe must not fail because of a connection flood).

The requests that hold connections are streams whose engine a test gate (tests/engine_gate.py) holds still.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engine_gate import BOUND_S, Stream, engine_requests, open_gate, set_gate, start_gated_server
from tests.server_fixtures import SERVED_NAME, ServerProcess, make_scripted_pair

LIMIT = 4


@dataclass
class Gated:
    server: ServerProcess
    gate: Path


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gated]:
    tmp = tmp_path_factory.mktemp("connections")
    target, _ = make_scripted_pair(tmp)
    args = [
        "--target", str(target), "--no-speculative", "--device", "cpu", "--served-model-name", SERVED_NAME,
        "--limit-concurrency", str(LIMIT), "--header-timeout", "1", "--keep-alive-timeout", "1",
    ]  # fmt: skip
    gate = tmp / "gate"
    proc = start_gated_server(args, tmp / "server.log", gate)
    try:
        proc.wait_ready()
        yield Gated(proc, gate)
    finally:
        open_gate(gate)
        proc.terminate()


def hold_streams(g: Gated, n: int) -> list[Stream]:
    """``n`` streams that have started (status 200, one event each) and then stay in progress (engine paused)."""
    set_gate(g.gate, 0)
    streams = [Stream(g.server.url, max_tokens=40) for _ in range(n)]
    for t in streams:
        t.start()
    deadline = time.monotonic() + BOUND_S
    while engine_requests(g.gate) < n:  # every request past the limit check and in the engine
        assert time.monotonic() < deadline, g.server.log_tail()
        for i, t in enumerate(streams):
            if t.first.is_set():  # refused: a closed connection the server had not noticed yet still counted
                assert t.status == 503, (t.status, t.error)
                streams[i] = Stream(g.server.url, max_tokens=40)
                streams[i].start()
        time.sleep(0.05)
    set_gate(g.gate, 1)  # one step: every request's prefill and first token
    for t in streams:
        assert t.first.wait(BOUND_S) and t.status == 200 and t.events, (t.status, t.error, g.server.log_tail())
    return streams


def connect(server: ServerProcess, send: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=BOUND_S)
    if send:
        s.sendall(send)
    return s


def wait_closed_by_server(s: socket.socket) -> None:
    """Read until the server closes ``s`` (EOF or reset); socket.timeout after BOUND_S."""
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass


def health(server: ServerProcess) -> httpx.Response:
    return httpx.get(f"{server.url}/health", timeout=BOUND_S)


def version(server: ServerProcess) -> httpx.Response:
    return httpx.get(f"{server.url}/version", timeout=BOUND_S)


def poll_version(server: ServerProcess, status: int) -> httpx.Response:
    deadline = time.monotonic() + BOUND_S
    while (r := version(server)).status_code != status:
        assert time.monotonic() < deadline, f"/version never answered {status}:\n{server.log_tail()}"
        time.sleep(0.05)
    return r


def test_limit_answers_503_fast_and_header_timeout_frees_idle_connections(gated: Gated) -> None:
    server = gated.server
    held = hold_streams(gated, LIMIT)  # LIMIT requests in progress
    idle = [connect(server) for _ in range(2)]  # connected, silent
    slow = connect(server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers that never end
    try:
        refused = version(server)  # one connection beyond the limit: refused at once, not queued
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        assert refused.json()["error"]["code"] == "too_many_connections"
        live = health(server)  # ... but never the liveness probe
        assert live.status_code == 200 and live.json()["status"] == "ok", live.text

        for s in [*idle, slow]:
            wait_closed_by_server(s)  # the header timeout
        assert version(server).status_code == 503  # the held requests still fill the limit
        assert all(t.is_alive() for t in held), "the header timeout cut a request in progress"
    finally:
        for s in [*idle, slow]:
            s.close()
        open_gate(gated.gate)
    for t in held:  # they run to their end: the header timeout never touched them
        t.join(BOUND_S)
        assert t.error is None and t.events[-1] == "[DONE]", (t.error, t.events[-2:])
    poll_version(server, 200)  # their connections are gone
    assert health(server).json() == {"status": "ok", "running": 0, "waiting": 0}


def test_keep_alive_connection_closes_after_the_keep_alive_timeout(gated: Gated) -> None:
    server = gated.server
    with connect(server, b"GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") as s:
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        wait_closed_by_server(s)

