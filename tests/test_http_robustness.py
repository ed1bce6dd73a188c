"""HTTP robustness on a real uvicorn server on 127.0.0.1 (``server.__main__.build_server``: the header timeout, the
connection limit) over a scripted engine: bodies that never arrive end with a 408 and a closed connection (and do
not lock the server out), a client that leaves mid-body is one info line, fields OpenAI allows as null take their
default, ``/tokenize`` refuses what chat refuses, errors name their field, a lone surrogate is named, and
``HEAD /health`` answers like GET.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from dflash_core.loading import LoadedModels
from server.__main__ import build_server
from server.app import create_app
from server.settings import Settings
from tests.fake_engine import FakeEngine, demo_tokenizer
from tests.server_fixtures import free_port

MODEL = "fake"
LIMIT = 4  # --limit-concurrency
GAP_S = 1.0  # --header-timeout: also the longest pause between two chunks of a body
BODY_S = 2.0  # --body-timeout: a whole body
BOUND_S = 10.0
ENVELOPE_KEYS = {"message", "type", "param", "code"}


@dataclass
class Served:
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = FakeEngine(tokenizer=demo_tokenizer())
    models = LoadedModels(engine=engine, tokenizer=demo_tokenizer(), target_name="fake-target",  # type: ignore[arg-type]
                          draft_name="fake-draft", device="cpu", dtype="float32", block_size=engine.block_size,
                          backend="fake")
    settings = Settings(served_model_name=MODEL, host="127.0.0.1", port=free_port(), limit_concurrency=LIMIT,
                        header_timeout=GAP_S, body_timeout=BODY_S)
    server = build_server(create_app(settings, models=models), settings)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}/health"
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    try:
        yield Served(settings.port)
    finally:
        server.should_exit = True
        thread.join(30)


def envelope(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ENVELOPE_KEYS, body
    return body["error"]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 8, **extra}


def post(served: Served, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(served.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=BOUND_S)


def head_of_body(served: Served, declared: int, sent: bytes) -> socket.socket:
    """A socket that sent a chat request's headers (``Content-Length: declared``) and only ``sent`` of its body."""
    s = socket.create_connection(("127.0.0.1", served.port), timeout=BOUND_S)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (declared, sent))
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout after BOUND_S)."""
    out = b""
    while piece := s.recv(65536):
        out += piece
    return out


def timed_out(raw: bytes) -> dict[str, Any]:
    """The 408 envelope of a raw response that closed its connection."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), raw
    assert b"connection: close" in head.lower(), raw
    error = json.loads(body)["error"]
    assert set(error) == ENVELOPE_KEYS and error["code"] == "request_timeout", error
    return error


# --- bodies that do not arrive ---------------------------------------------------------------------------------


def test_a_stalled_body_is_a_408_and_the_connection_closes(served: Served) -> None:
    s = head_of_body(served, 1000, b"{")
    t0 = time.monotonic()
    with s:
        timed_out(read_all(s))
    assert time.monotonic() - t0 < GAP_S + 3


def test_a_trickled_body_is_bounded_as_a_whole(served: Served) -> None:
    s = head_of_body(served, 1000, b"{")
    t0 = time.monotonic()
    stop = threading.Event()

    def trickle() -> None:  # a byte every half gap: never a pause long enough for the gap timeout
        while not stop.wait(GAP_S / 2):
            try:
                s.sendall(b" ")
            except OSError:
                return

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    try:
        with s:
            timed_out(read_all(s))
    finally:
        stop.set()
        feeder.join()
    assert BODY_S <= time.monotonic() - t0 < BODY_S + 3


def test_stalled_bodies_do_not_lock_the_server_out(served: Served) -> None:
    sockets = [head_of_body(served, 1000, b"{") for _ in range(LIMIT + 2)]
    try:
        deadline = time.monotonic() + GAP_S + 5
        while True:  # refused while the stalled bodies hold every connection, then served
            r = post(served, "/v1/chat/completions", chat())
            if r.status_code == 200:
                break
            assert r.status_code == 503 and time.monotonic() < deadline, r.text
            time.sleep(0.1)
    finally:
        for s in sockets:
            s.close()


def test_a_client_that_leaves_mid_body_is_one_info_line(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with head_of_body(served, 1000, b'{"model": "fake", "mess'):
        time.sleep(0.2)  # the route is reading the body
    deadline = time.monotonic() + BOUND_S
    while not any("disconnected" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    time.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    gone = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].exc_info is None, caplog.text
    assert post(served, "/v1/chat/completions", chat()).status_code == 200


# --- fields ------------------------------------------------------------------------------------------------------

NULLABLE_SHARED = ["stream", "n", "min_tokens", "skip_special_tokens", "ignore_eos", "include_stop_str_in_output",
                   "stream_options", "temperature", "top_p", "seed", "stop", "logit_bias", "user", "metadata"]


@pytest.mark.parametrize("field", [*NULLABLE_SHARED, "logprobs", "top_logprobs", "max_completion_tokens",
                                   "add_generation_prompt", "continue_final_message", "tools", "tool_choice",
                                   "response_format", "parallel_tool_calls"])
def test_null_chat_fields_take_their_default(served: Served, field: str) -> None:
    r = post(served, "/v1/chat/completions", chat(**{field: None}))
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion" and len(r.json()["choices"]) == 1


@pytest.mark.parametrize("field", [*NULLABLE_SHARED, "logprobs", "echo", "suffix", "best_of"])
def test_null_completion_fields_take_their_default(served: Served, field: str) -> None:
    r = post(served, "/v1/completions", completion(**{field: None}))
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion" and r.json()["choices"][0]["text"] == "ok"


@pytest.mark.parametrize(("field", "value"), [("stream", "yes"), ("n", "2"), ("logprobs", 1), ("min_tokens", 1.5),
                                              ("skip_special_tokens", 0), ("add_generation_prompt", "false")])
def test_wrong_types_are_still_refused(served: Served, field: str, value: Any) -> None:
    assert envelope(post(served, "/v1/chat/completions", chat(**{field: value})), 400)["param"] == field


@pytest.mark.parametrize("field", ["model", "messages"])
def test_required_fields_are_not_nullable(served: Served, field: str) -> None:
    assert envelope(post(served, "/v1/chat/completions", chat(**{field: None})), 400)["param"] == field


def test_tokenize_refuses_what_chat_refuses(served: Served) -> None:
    messages = [{"role": "user", "content": "hi"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    refused = envelope(post(served, "/v1/chat/completions", chat(messages=messages, **extra)), 400)
    r = post(served, "/tokenize", {"model": MODEL, "messages": messages, **extra})
    assert envelope(r, 400) == refused and refused["param"] == "continue_final_message"
    both = {"continue_final_message": True, "add_generation_prompt": True}
    refused = envelope(post(served, "/v1/chat/completions", chat(**both)), 400)
    assert envelope(post(served, "/tokenize", {"messages": messages, **both}), 400) == refused
    ok = [*messages, {"role": "assistant", "content": "Hel"}]
    r = post(served, "/tokenize", {"messages": ok, **extra})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    r = post(served, "/tokenize", {"messages": messages, "add_generation_prompt": None, "continue_final_message": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("extra", "param"), [({"stop_token_ids": [-1]}, "stop_token_ids"),
                                              ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
                                              ({"min_tokens": -1}, "min_tokens")])
def test_token_field_errors_name_their_field(served: Served, path: str, extra: dict[str, Any], param: str) -> None:
    body = chat(**extra) if path.endswith("chat/completions") else completion(**extra)
    error = envelope(post(served, path, body), 400)
    assert error["param"] == param and param in error["message"], error


def test_min_tokens_within_max_completion_tokens(served: Served) -> None:
    r = post(served, "/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=4, min_tokens=9))
    assert envelope(r, 400)["param"] == "min_tokens"
    assert post(served, "/v1/chat/completions", chat(min_tokens=8)).status_code == 200


@pytest.mark.parametrize("escape", [b"\\ud800", b"\\ud800x", b"\\udc00", b"\\ud800\\u0041"])
def test_a_lone_surrogate_is_named(served: Served, escape: bytes) -> None:
    body = b'{"model": "fake", "messages": [{"role": "user", "content": "a' + escape + b'"}]}'
    error = envelope(post(served, "/v1/chat/completions", body), 400)
    assert "lone surrogate" in error["message"] and "hex escape" not in error["message"], error
    r = post(served, "/v1/chat/completions", chat(messages=[{"role": "user", "content": "\U0001F600"}]))
    assert r.status_code == 200, r.text


def test_head_health_answers_like_get(served: Served) -> None:
    get = httpx.get(served.url + "/health", timeout=BOUND_S)
    head = httpx.head(served.url + "/health", timeout=BOUND_S)
    assert get.status_code == head.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
