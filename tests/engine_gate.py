"""``python -m tests.engine_gate ARGS``: the real server (``server.__main__``) with a test gate on the engine.

While the file named by ``$DFLASH_TEST_GATE`` exists, ``Engine.step`` runs only as many more steps as the number
written in it (counted from when the file was last written), then returns no output: requests stay exactly where
they are, so a test can hold a stream mid-way (or a request in the queue) without relying on timing. Deleting the
file lets the engine run freely again. Nothing else changes; the worker keeps taking commands while paused.
While paused, the engine's number of admitted requests is written to ``<gate>.active`` (``engine_requests``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server_fixtures import SERVED_NAME, ServerProcess, start_server

GATE_ENV = "DFLASH_TEST_GATE"
CHAT = [{"role": "user", "content": "Say hi."}]
BOUND_S = 60.0  # generous upper bound of every wait in these tests (a failure, never a pass condition)


def set_gate(path: Path, steps: int) -> None:
    """Allow ``steps`` more engine steps, then pause (atomic, so the server never reads half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(steps))
    os.replace(tmp, path)


def open_gate(path: Path) -> None:
    """Let the engine run freely."""
    path.unlink(missing_ok=True)
    path.with_suffix(".active").unlink(missing_ok=True)


def engine_requests(path: Path) -> int:
    """Requests in the paused engine (admitted by the worker), as last written by the server; 0 before."""
    try:
        return int(path.with_suffix(".active").read_text() or 0)
    except FileNotFoundError:
        return 0


def start_gated_server(args: list[str], log: Path, gate: Path) -> ServerProcess:
    """``tests.server_fixtures.start_server``, through this module, with the gate file at ``gate``."""
    return start_server(args, log, env={GATE_ENV: str(gate)}, module="tests.engine_gate")


def chat(stream: bool, max_tokens: int) -> dict[str, Any]:
    """A greedy chat request that runs ``max_tokens`` steps (EOS ignored)."""
    return {
        "model": SERVED_NAME,
        "messages": CHAT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


class Stream(threading.Thread):
    """A streamed chat completion read in the background: its status and every ``data:`` payload, parsed."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[Any] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.first = threading.Event()  # set on the first event, or when the response ends without one

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/chat/completions", json=chat(True, self.max_tokens), timeout=BOUND_S
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first.set()


def _install(gate: Path) -> None:
    from dflash_core.engine import Engine

    step = Engine.step
    seen: dict[str, Any] = {"key": None, "left": 0, "active": None}
    active_file = gate.with_suffix(".active")

    def gated_step(self: Engine) -> Any:
        try:
            st = gate.stat()
        except FileNotFoundError:
            return step(self)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != seen["key"]:
            seen["key"], seen["left"], seen["active"] = key, int(gate.read_text() or 0), None
        if seen["left"] <= 0:
            active = len(self._active)
            if active != seen["active"]:
                tmp = active_file.with_suffix(".active-tmp")
                tmp.write_text(str(active))
                os.replace(tmp, active_file)
                seen["active"] = active
            time.sleep(0.01)
            return []
        seen["left"] -= 1
        return step(self)

    Engine.step = gated_step  # type: ignore[method-assign]


if __name__ == "__main__":
    _install(Path(os.environ[GATE_ENV]))
    from server.__main__ import main

    sys.exit(main())
