"""`dflash-bench profile`'s serving part: the same requests in-process, through the server's worker thread, and
over HTTP from a real `dflash-serve`, one at a time, in alternating rounds.

Three paths, each over every prompt (greedy, the profile's token budget), timed from the chat messages to the
text (the chat template, the engine's steps, the detokenizer):

  in-process   the engine stepped in this thread, as `LLM.generate` does
  worker       the server's `Worker` thread around the same engine, its events read by an asyncio loop here (the
               two threads on one core when the server runs them so: `--one-core`, its default on a CPU with one
               torch thread running PyTorch's forward; a step's events held as the server holds them): what handing
               each step's output from the engine thread to the event loop costs
  http         a `dflash-serve` subprocess with the same engine settings, streamed (`stream: true`, one SSE event
               per engine step) over 127.0.0.1: the worker plus uvicorn, FastAPI, the request's parsing and SSE

The order of the paths flips every round, so that a machine's drift over a run weighs on each alike; a path's
rate is the median over rounds, its share of the in-process rate the median of the rounds' own ratios, and what a
path adds per token (the worker hand-off; HTTP and SSE) the median of the rounds' own differences.
Every path's text must equal the in-process text of the same prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_core.bench.errors import BenchError
from dflash_core.bench.offline import encode_prompt
from dflash_core.bench.prompts import Prompt

PATHS = ("in-process", "worker", "http")
# what each path adds to the one before it, ms per token: (result key, path, the path before)
STAGES = (("worker_handoff_ms_per_token", "worker", "in-process"), ("http_sse_ms_per_token", "http", "worker"))
READY_TIMEOUT_S = 300.0


@dataclass
class PathRun:
    """One pass of a path over the prompts."""

    tokens: int
    seconds: float
    texts: list[str]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def run_alone(engine: Any, tokenizer: Any, ids: list[int], params: Any,
              detokenizer_scope: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
              ) -> tuple[str, int, int]:
    """One request alone on `engine`, stepped to the end with its text detokenized as the server does (each step's
    detokenizing inside `detokenizer_scope()`): (text, tokens, steps)."""
    from dflash_core.detokenize import OutputText

    rid = engine.add_request(ids, params)
    text, pieces = OutputText(tokenizer, ids), []
    tokens = steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        with detokenizer_scope():
            for out in outs:
                if out.error:
                    raise BenchError(f"the engine failed: {out.error}", code=1)
                if out.request_id == rid:
                    step = text.step(out)
                    pieces.append(step.text)
                    tokens += len(step.token_ids)
    engine.release(rid)
    return "".join(pieces), tokens, steps


def run_in_process(engine: Any, tokenizer: Any, prompts: Sequence[Prompt], params: Any) -> PathRun:
    """Each prompt alone on `engine` in this thread: template, steps, detokenizer."""
    tokens, texts = 0, []
    t0 = time.perf_counter()
    for p in prompts:
        text, n, _ = run_alone(engine, tokenizer, encode_prompt(tokenizer, p.messages), params)
        tokens += n
        texts.append(text)
    return PathRun(tokens, time.perf_counter() - t0, texts)


class WorkerPath:
    """The server's worker thread around `engine`, fed from an asyncio loop in this thread."""

    def __init__(self, engine: Any, tokenizer: Any, name: str, one_core: bool) -> None:
        from prometheus_client import CollectorRegistry

        from dflash_core.overlap import pays_to_hold
        from server.handoff import poll_interval
        from server.metrics import ServerMetrics
        from server.worker import Worker

        metrics = ServerMetrics(block_size=engine.block_size, target=name, draft="", device="cpu", backend="bench",
                                registry=CollectorRegistry())
        self.tokenizer, self.one_core = tokenizer, one_core
        self.worker = Worker(engine, tokenizer, metrics, max_running=1, max_waiting=1,
                             hold_events=pays_to_hold("cpu", engine.target.cpu_step),
                             poll_events_s=poll_interval("cpu"))
        self.worker.start()

    def run(self, prompts: Sequence[Prompt], params: Any) -> PathRun:
        """One pass; with `one_core` the loop's thread and the worker's on one core, as `dflash-serve --one-core`
        runs them."""
        from server import affinity

        worker = self.worker.thread_id
        if not self.one_core or worker is None or not affinity.supported():
            return asyncio.run(self._run(prompts, params))
        with affinity.sharing_one_core([threading.get_native_id(), worker]):
            return asyncio.run(self._run(prompts, params))

    async def _run(self, prompts: Sequence[Prompt], params: Any) -> PathRun:
        from server.handoff import RequestHandle, WorkerEvent

        loop = asyncio.get_running_loop()
        tokens, texts = 0, []
        t0 = time.perf_counter()
        for p in prompts:
            queue: asyncio.Queue[WorkerEvent] = asyncio.Queue()
            ids = encode_prompt(self.tokenizer, p.messages)
            self.worker.submit([RequestHandle(index=0, prompt_token_ids=ids, params=params, loop=loop, queue=queue)])
            pieces = []
            while True:
                ev = await queue.get()
                if ev.error is not None:
                    raise BenchError(f"the worker failed: {ev.error.message}", code=1)
                pieces.append(ev.text)
                tokens += ev.num_tokens
                if ev.finish_reason is not None:
                    break
            texts.append("".join(pieces))
        return PathRun(tokens, time.perf_counter() - t0, texts)

    def close(self) -> None:
        self.worker.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command() -> list[str]:
    """`dflash-serve` of this environment (the console script beside this Python, else on PATH)."""
    exe = Path(sys.executable).parent / "dflash-serve"
    found = str(exe) if exe.exists() else shutil.which("dflash-serve")
    if found is None:
        raise BenchError("dflash-serve is not installed in this environment (pip install -e .)")
    return [found]


class ServerProcess:
    """A `dflash-serve` subprocess on a free 127.0.0.1 port; its log in a temporary file."""

    def __init__(self, args: Sequence[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*serve_command(), *args, "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        self.cmd = cmd
        self.log = tempfile.NamedTemporaryFile("w+", prefix="dflash-bench-serve-", suffix=".log", delete=False)
        try:
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
            raise

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"dflash-serve exited ({self.proc.returncode}): {self.tail()}", code=1)
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            time.sleep(0.2)
        raise BenchError(f"dflash-serve was not ready within {timeout:.0f} s: {self.tail()}", code=1)

    def tail(self, lines: int = 5) -> str:
        self.log.flush()
        return " | ".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def stream_chat(conn: http.client.HTTPConnection, body: dict[str, Any]) -> tuple[str, int]:
    """One streamed chat completion: (its text, completion tokens from the usage chunk)."""
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise BenchError(f"dflash-serve answered {resp.status}: {resp.read()[:300]!r}", code=1)
    pieces, tokens = [], None
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        try:
            chunk = json.loads(line[6:])
        except json.JSONDecodeError:
            raise BenchError(f"dflash-serve sent an event that is not JSON: {line[:200]!r}", code=1) from None
        if "error" in chunk:
            raise BenchError(f"dflash-serve failed: {chunk['error'].get('message')}", code=1)
        for choice in chunk.get("choices") or ():
            pieces.append(choice.get("delta", {}).get("content") or "")
        if chunk.get("usage"):
            tokens = int(chunk["usage"]["completion_tokens"])
    if tokens is None:
        raise BenchError("dflash-serve's stream ended without its usage chunk", code=1)
    return "".join(pieces), tokens


def run_http(server: ServerProcess, model: str, prompts: Sequence[Prompt], max_tokens: int,
             ignore_eos: bool) -> PathRun:
    """Each prompt as one streamed chat completion, one at a time, on one kept-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    tokens, texts = 0, []
    t0 = time.perf_counter()
    try:
        for p in prompts:
            body = {"model": model, "messages": p.messages, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
            text, n = stream_chat(conn, body)
            tokens += n
            texts.append(text)
    finally:
        conn.close()
    return PathRun(tokens, time.perf_counter() - t0, texts)


@contextlib.contextmanager
def serving(*args: Sequence[str]) -> Iterator[list[ServerProcess]]:
    """One ready `dflash-serve` per argument list (started together, so their loading overlaps), stopped
    afterwards."""
    servers: list[ServerProcess] = []
    try:
        for a in args:
            servers.append(ServerProcess(a))
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


def compare_paths(engine: Any, tokenizer: Any, name: str, server: ServerProcess, prompts: Sequence[Prompt],
                  params: Any, rounds: int, one_core: bool) -> dict[str, Any]:
    """`rounds` alternating rounds of the three paths (after one untimed pass of each); tok/s, ms/token and the
    share of the in-process rate, per path. `one_core`: the worker path's threads on one core, as the server's."""
    model = _served_model(server)
    worker = WorkerPath(engine, tokenizer, name, one_core)
    try:
        runners = {
            "in-process": lambda: run_in_process(engine, tokenizer, prompts, params),
            "worker": lambda: worker.run(prompts, params),
            "http": lambda: run_http(server, model, prompts, params.max_tokens, params.ignore_eos),
        }
        for path in PATHS:  # warm: the first request of each path pays for lazy set-up
            runners[path]()
        runs: dict[str, list[PathRun]] = {p: [] for p in PATHS}
        for r in range(rounds):
            for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                runs[path].append(runners[path]())
    finally:
        worker.close()
    _check_texts(runs, prompts)
    out: dict[str, Any] = {}
    for path in PATHS:
        rates = [run.tokens_per_s for run in runs[path]]
        shares = [a.tokens_per_s / b.tokens_per_s for a, b in zip(runs[path], runs["in-process"])]
        out[path] = {"tokens_per_s": statistics.median(rates), "rounds_tokens_per_s": rates,
                     "ms_per_token": 1000 / statistics.median(rates), "share_of_in_process": statistics.median(shares),
                     "tokens": runs[path][0].tokens}
    for label, a, b in STAGES:  # paired by round: a drift of the machine over the run cancels out
        out[label] = statistics.median(_ms_per_token(x) - _ms_per_token(y) for x, y in zip(runs[a], runs[b]))
    return out


def _ms_per_token(run: PathRun) -> float:
    return 1000 * run.seconds / run.tokens


def _served_model(server: ServerProcess) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/v1/models")
        return str(json.loads(conn.getresponse().read())["data"][0]["id"])
    finally:
        conn.close()


def _check_texts(runs: dict[str, list[PathRun]], prompts: Sequence[Prompt]) -> None:
    """Every path's text of every prompt equals the in-process one (greedy: the same tokens)."""
    ref = runs["in-process"][0].texts
    for path, path_runs in runs.items():
        for run in path_runs:
            for i, (a, b) in enumerate(zip(run.texts, ref)):
                if a != b:
                    raise BenchError(f"the {path} path's text of prompt {i} ({prompts[i].source}) differs from the "
                                     f"in-process text: {a[:80]!r} vs {b[:80]!r}", code=1)


def one_core(threads: int, serve_extra: Sequence[str], cpu_step: str) -> bool:
    """Whether the served subprocess pins its two threads to one core (its flags, else its default for what runs
    its forwards, `cpu_step`: the same as in this process)."""
    from server import affinity

    flags = [a for a in serve_extra if a in ("--one-core", "--no-one-core")]
    return flags[-1] == "--one-core" if flags else affinity.default_on("cpu", threads, cpu_step)


def serve_args(target: str | None, draft: str | None, threads: int, speculative: bool) -> list[str]:
    """`dflash-serve` arguments for the engine the profile builds in-process."""
    # no generation-config defaults: the in-process engine runs the request's own sampling settings alone
    args = ["--device", "cpu", "--threads", str(threads), "--max-running-requests", "8", "--generation-config", "none"]
    if target is not None:
        args += ["--target", target]
    if draft is not None:
        args += ["--draft", draft]
    return args + (["--speculation", "fixed"] if speculative else ["--no-speculative"])
