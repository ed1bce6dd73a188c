"""Helpers for end-to-end server tests: a scripted tiny model pair and ``python -m server`` subprocesses.

The scripted pair is ``tests.helpers.make_tiny_pair`` with its weights edited so that the output is known:
every decoder layer writes zeros into the residual stream (``o_proj`` and ``down_proj`` are zero), so the
target's next token depends on the current token only, and the output head maps chosen tokens to chosen
successors. After the chat prompt (which ends with a newline token) greedy decoding emits ``SCRIPT`` one
byte-level token per byte (every multi-byte character split across tokens), then EOS. The draft's layers are
zeroed the same way, so it proposes ``next(mask)`` at every position; that token is ``SCRIPT[ACCEPTED_AT]``,
so the verify step that reaches it accepts one draft token and commits two tokens in one step. The other
tokens' embeddings are orthogonal to the script's, so they keep random successors and completions of
different prompts differ.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file, save_file

from dflash_core.detokenize import _bytes_to_unicode
from tests.helpers import make_tiny_pair

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "Hi 你😀é".encode() + b"\xff" + "✨".encode()  # 16 distinct bytes; 0xFF is never valid UTF-8
SCRIPT_TEXT = SCRIPT.decode("utf-8", errors="replace")  # "Hi 你😀é\ufffd✨"
ACCEPTED_AT = 3  # the draft always proposes SCRIPT[3] (first byte of 你)
SCALE = 30.0  # logit margin of scripted successors
SERVED_NAME = "tiny"
START_TIMEOUT_S = 120.0


def _edit(path: Path, edit) -> None:  # noqa: ANN001
    state = load_file(str(path))
    edit(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})


def make_scripted_pair(folder: Path) -> tuple[Path, Path]:
    """(target_dir, draft_dir) whose greedy chat answer is SCRIPT followed by EOS."""
    from transformers import AutoTokenizer

    target_dir, draft_dir = make_tiny_pair(folder)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    vocab = tok.get_vocab()
    table = _bytes_to_unicode()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
    )
    last = tok(prompt, add_special_tokens=False)["input_ids"][-1]
    script_ids = [vocab[table[b]] for b in SCRIPT]
    chain = [last, *script_ids, tok.eos_token_id]
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    successors = dict(zip(chain[:-1], chain[1:], strict=True))
    successors[mask_id] = script_ids[ACCEPTED_AT]
    assert len(successors) == len(chain), "script tokens must be distinct"

    def edit_target(state: dict[str, torch.Tensor]) -> None:
        for k in state:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                state[k].zero_()
        state["model.norm.weight"].fill_(1.0)
        emb, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
        hidden = emb.shape[1]
        gen = torch.Generator().manual_seed(0)
        basis, _ = torch.linalg.qr(torch.randn(hidden, len(successors), generator=gen))
        emb -= (emb @ basis) @ basis.T  # other tokens do not see the script: they keep random successors
        for i, (tok_id, nxt) in enumerate(successors.items()):
            emb[tok_id] = basis[:, i] * math.sqrt(hidden)  # unit RMS: the final norm leaves it unchanged
            head[nxt] += basis[:, i] * (SCALE / math.sqrt(hidden))

    def edit_draft(state: dict[str, torch.Tensor]) -> None:
        for k in state:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                state[k].zero_()
        state["norm.weight"].fill_(1.0)

    _edit(target_dir / "model.safetensors", edit_target)
    _edit(draft_dir / "model.safetensors", edit_draft)
    return target_dir, draft_dir


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, n: int = 4000) -> str:
    """The end of a subprocess log, for failure messages ("" when it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    """SIGTERM a subprocess we started, wait, return its exit code (kill after ``timeout_s``)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return int(proc.returncode)


@dataclass
class StreamStart:
    """The start of an HTTP/1.1 response read off a raw socket: status, headers, and the first body chunk."""

    status: int
    headers: dict[str, str]
    first_chunk: bytes
    seconds: float  # from sending the request to having the first chunk


def read_stream_start(
    port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout_s: float = 60.0
) -> StreamStart:
    """POST ``body`` as JSON to 127.0.0.1:``port`` over a raw socket and read the response up to its first body
    chunk (chunked transfer encoding: exactly the bytes of the server's first send), then close the connection."""
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {len(payload)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        t0 = time.monotonic()
        sock.sendall(request)
        buf = b""

        def more() -> None:
            nonlocal buf
            piece = sock.recv(65536)
            if not piece:
                raise ConnectionError(f"the server closed the connection; got {buf!r}")
            buf += piece

        while b"\r\n\r\n" not in buf:
            more()
        head, buf = buf.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        parsed = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        if parsed.get("transfer-encoding") != "chunked":
            raise AssertionError(f"not a chunked response: {status_line} {parsed}")
        while b"\r\n" not in buf:
            more()
        size_line, buf = buf.split(b"\r\n", 1)
        size = int(size_line.split(b";")[0], 16)
        while len(buf) < size:
            more()
        return StreamStart(int(status_line.split()[1]), parsed, buf[:size], time.monotonic() - t0)


@dataclass
class ServerProcess:
    """A ``python -m server`` subprocess on 127.0.0.1."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    saw_503: bool = False  # /health answered 503 (loading) before 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        return log_tail(self.log, n)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll /health until 200 (503 while loading is expected); fail if the process dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200:
                    return
                self.saw_503 |= r.status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait, return the exit code (kill after the timeout)."""
        return stop_process(self.proc, timeout_s)


def start_server(
    args: list[str], log: Path, env: dict[str, str] | None = None, module: str = "server"
) -> ServerProcess:
    """Start ``python -m MODULE ARGS --port <free>`` (does not wait for readiness); ``env`` adds variables.

    ``module`` is ``server`` (what ``dflash-serve`` runs) or a test wrapper of it such as ``tests.engine_gate``.
    """
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    full_env["PYTHONUNBUFFERED"] = "1"
    # tiny models: more threads only fight over the CPUs (3-5x slower on 2 busy cores)
    full_env["OMP_NUM_THREADS"] = "1"
    full_env["HF_HUB_OFFLINE"] = "1"
    full_env.update(env or {})
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return ServerProcess(proc, port, log)


class InProcessServer:
    """A uvicorn server for ``app`` in a thread of the test process (for tests that reach into the app)."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None, lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> InProcessServer:
        """Start and wait until /health answers 200."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError("the in-process server stopped")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"in-process server not ready after {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
