"""``dflash-serve`` / ``python -m server``: check the settings, start uvicorn, drain on SIGTERM.

Start-up: settings (one line and exit 2 when one is impossible), logging, then cheap checks that need no model
(a ``--target`` / ``--draft`` / ``--tokenizer`` that is neither a folder nor a hub id, ``--device cuda`` without
CUDA: one line and exit 1). The models load in the background so that ``/health`` answers 503 meanwhile; a load
failure logs one line (the traceback with ``--log-level debug``) and exits 1.

Connections: ``--limit-concurrency`` open connections (idle ones count) or requests in progress at most; beyond,
a request gets an immediate 503 envelope and its connection is closed. ``--header-timeout`` closes a connection
whose request headers have not arrived that long after it opened (or after its previous response), which uvicorn
alone never does; ``--keep-alive-timeout`` is uvicorn's idle keep-alive timeout. A request body that pauses longer
than the header timeout, or takes longer than ``--body-timeout`` in all, is answered 408 and its connection closed
(``server.checks``).

Shutdown (SIGTERM or SIGINT): the server stops admitting (new requests and ``/health`` get 503) and lets the
requests in progress finish for up to ``--shutdown-timeout`` seconds. Then running streams get an error event and
``data: [DONE]``, non-streamed and queued requests a 503 envelope; once those are sent uvicorn closes the
connections and the process exits 0. A second SIGTERM / SIGINT exits at once (status 128 + signal number).

SIGHUP: the draft folder is read again and swapped in while serving (``server.draft_swap``); a failure is logged and
the old draft serves on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.server import ServerState as UvicornState

import dflash_core  # noqa: F401  # before server.app loads torch: sets OMP_WAIT_POLICY=PASSIVE (see its docstring)
from dflash_core.quant.formats import gguf_refusal
from server import affinity
from server.api_error import RETRY_AFTER_S
from server.app import create_app
from server.logs import setup_logging
from server.settings import Settings, read_yaml, resolve_settings
from server.state import ServerState

log = logging.getLogger("dflash.server")
FLUSH_S = 5.0  # after the shutdown timeout: time for failed requests' last bytes, then for uvicorn to close
DRAIN_POLL_S = 0.05
OPEN_FILES_SLACK = 256  # file descriptors beyond the connections: model files, pipes, the event loop
# Hub ids look like "name" or "org/name"; a path with more parts, or starting with "/", "." or "~", is a path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


# --- start-up checks -----------------------------------------------------------------------------------------


def _is_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and ".." not in value and "--" not in value


def _device_problem(device: str) -> str | None:
    name = device.strip().lower()
    if name in ("", "auto", "cpu"):
        return None
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        return f"--device {device!r} is not a device; use auto, cpu, cuda or cuda:N"
    if dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        return f"--device {device}: CUDA is not available ({why}; torch {torch.__version__})"
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        return f"--device {device}: there are only {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
    return None


def _budget_problem(settings: Settings) -> str | None:
    """--gpu-memory-utilization where no CUDA card will hold the KV pool (found before the models load)."""
    if settings.gpu_memory_utilization is None:
        return None
    name = settings.device.strip().lower()
    if name in ("", "auto"):
        import torch

        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        return None
    return f"--gpu-memory-utilization sizes the KV pool of a CUDA card; on {name} use --kv-cache-memory"


def preflight(settings: Settings) -> str | None:
    """The first mistake that needs no model to find (a path that is not there, CUDA that is not, a CUDA-only
    budget without CUDA), or None."""
    refusal = gguf_refusal(settings.target) if settings.target is not None else None
    if refusal:  # first: a GGUF name need not be a folder or a hub id ("org/name-GGUF:Q4_K_M")
        return f"--target {refusal}"
    for name in ("target", "draft", "tokenizer"):
        value = getattr(settings, name)
        if value is None or (name == "draft" and not settings.speculative):
            continue
        if not Path(value).expanduser().exists() and not _is_hub_id(value):
            return f"--{name} {value}: no such folder (and not a hub id such as 'org/name')"
    return (_device_problem(settings.device) or _budget_problem(settings) or _record_problem(settings)
            or _adapt_problem(settings))


def _adapt_problem(settings: Settings) -> str | None:
    """--adapt-draft trains from the draft's folder (a hub id is not one), and a DFlash draft only."""
    if not settings.adapt_draft:
        return None
    from dflash_core.draft_formats import read_draft_config
    from dflash_core.loading import DEMO_DRAFT

    draft = Path(settings.draft).expanduser() if settings.draft is not None else DEMO_DRAFT
    if not draft.is_dir():
        return (f"--adapt-draft: the draft {settings.draft} is not a local folder (dflash-train --init-draft reads "
                f"one): download it and pass the folder")
    try:
        dflash2 = read_draft_config(draft).dflash2 is not None
    except (OSError, ValueError) as exc:
        return f"--draft {draft}: {exc}"
    if dflash2:
        return "--adapt-draft: the draft is a DFlash 2 draft, which dflash-train cannot fine-tune (DFlash drafts only)"
    return None


def _record_problem(settings: Settings) -> str | None:
    """--record-traffic's folder: creatable and writable."""
    if settings.record_traffic is None:
        return None
    folder = Path(settings.record_traffic).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--record-traffic {settings.record_traffic}: cannot create the folder ({exc.strerror or exc})"
    if not os.access(folder, os.W_OK):
        return f"--record-traffic {settings.record_traffic}: the folder is not writable"
    return None


def _raise_open_files_limit(connections: int) -> None:
    """Lift the soft RLIMIT_NOFILE so that ``connections`` sockets fit (accept() fails with EMFILE otherwise)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return
    wanted = connections + OPEN_FILES_SLACK
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            new = soft
    if new < wanted:
        log.warning(
            "the open-file limit (%d) is below limit_concurrency + %d (%d): raise it (ulimit -n) or lower "
            "--limit-concurrency",
            new,
            OPEN_FILES_SLACK,
            wanted,
        )


# --- connections ---------------------------------------------------------------------------------------------


class _HeaderTimeout:
    """Mixin for uvicorn's HTTP protocol: close a connection whose request headers are late.

    The timer starts when the connection opens and again when a response is complete; it is moot once a
    request's headers have arrived (uvicorn then starts a new request cycle). uvicorn's keep-alive timer is
    cancelled by any byte received, so without this a client that trickles a header forever holds a connection.
    """

    header_timeout: float = 10.0
    _dflash_timer: asyncio.TimerHandle | None = None
    _dflash_cycle: Any = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._dflash_arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._dflash_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._dflash_disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _dflash_disarm(self) -> None:
        if self._dflash_timer is not None:
            self._dflash_timer.cancel()
            self._dflash_timer = None

    def _dflash_arm(self) -> None:
        self._dflash_disarm()
        transport = self.transport  # type: ignore[attr-defined]
        if transport is None or transport.is_closing():
            return
        self._dflash_cycle = self.cycle  # type: ignore[attr-defined]
        self._dflash_timer = self.loop.call_later(self.header_timeout, self._dflash_expired)  # type: ignore

    def _dflash_expired(self) -> None:
        self._dflash_timer = None
        cycle = self.cycle  # type: ignore[attr-defined]
        idle = cycle is self._dflash_cycle and (cycle is None or cycle.response_complete)
        transport = self.transport  # type: ignore[attr-defined]
        if idle and not transport.is_closing():
            log.debug("closing a connection that sent no request headers within %.1f s", self.header_timeout)
            transport.close()


def http_protocol(header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools, else h11) with the request-header timeout."""
    return type("DflashHTTPProtocol", (_HeaderTimeout, AutoHTTPProtocol), {"header_timeout": header_timeout})


def _is_health(scope: dict[str, Any]) -> bool:
    """``GET /health`` (or HEAD), which the connection limit never refuses."""
    return scope.get("path") == "/health" and scope.get("method") in ("GET", "HEAD")


class ConnectionLimit:
    """ASGI middleware: beyond ``limit`` open connections or requests in progress, a fast 503 envelope.

    Like uvicorn's ``limit_concurrency`` (idle keep-alive connections count), but the answer is the OpenAI error
    envelope with ``Retry-After`` and ``Connection: close``, and the limit admits ``limit`` connections.
    ``GET /health`` is never refused (it still counts): it is cheap, and a liveness probe that a connection
    flood turned into 503s would have the orchestrator restart a healthy server.
    """

    def __init__(self, app: Any, limit: int, uvicorn_state: Callable[[], UvicornState]) -> None:
        self.app = app
        self.limit = limit
        self._uvicorn_state = uvicorn_state
        self._refused = 0
        self._last_warning = 0.0
        body = {
            "error": {
                "message": f"too many connections (limit {limit}); retry later",
                "type": "service_unavailable",
                "param": None,
                "code": "too_many_connections",
            }
        }
        self._body = json.dumps(body).encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not _is_health(scope):
            st = self._uvicorn_state()
            if len(st.connections) > self.limit or len(st.tasks) > self.limit:
                self._warn(len(st.connections))
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(self._body)).encode()),
                    (b"retry-after", str(RETRY_AFTER_S).encode()),
                    (b"connection", b"close"),
                ]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": self._body})
                return
        await self.app(scope, receive, send)

    def _warn(self, connections: int) -> None:
        """One warning per 5 s at most (a flood must not flood the log too)."""
        self._refused += 1
        now = time.monotonic()
        if now - self._last_warning >= 5.0:
            log.warning(
                "connection limit %d reached (%d open): refused %d request(s) with 503",
                self.limit,
                connections,
                self._refused,
            )
            self._last_warning = now
            self._refused = 0


# --- shutdown ------------------------------------------------------------------------------------------------


def _exit_now(signum: int, frame: FrameType | None) -> None:
    """SIGTERM / SIGINT while draining (a second signal), or before / after uvicorn serves: exit at once."""
    log.warning("%s: exiting now, without draining", signal.Signals(signum).name)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(128 + signum)


class DflashServer(uvicorn.Server):
    """uvicorn's server with a drain on the first SIGTERM / SIGINT and an immediate exit on the second."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._signal: int | None = None
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread): start draining; a second signal exits at once."""
        if self._signal is not None:
            _exit_now(sig, frame)
        self._signal = sig  # on_tick starts the drain on the event loop

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's 0.1 s tick: start the drain once a signal came."""
        if self._signal is not None and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain(self._signal))
        return await super().on_tick(counter)

    async def _drain(self, sig: int) -> None:
        try:
            await self._drain_requests(sig)
        except Exception:
            log.exception("draining failed")
        finally:
            self.should_exit = True

    async def _drain_requests(self, sig: int) -> None:
        state = self.state
        state.draining = True  # from now on _check_ready refuses and /health answers 503
        loop = asyncio.get_running_loop()
        pending = {t for t in self.server_state.tasks if not t.done()}

        def busy() -> bool:
            nonlocal pending
            pending = {t for t in pending if not t.done()}
            return bool(pending) or (state.worker is not None and state.worker.in_flight > 0)

        log.info(
            "%s: draining: new requests get 503; waiting up to %g s for %d request(s) in progress "
            "(send the signal again to exit at once)",
            signal.Signals(sig).name,
            self.shutdown_timeout,
            len(pending),
        )
        deadline = loop.time() + self.shutdown_timeout
        while busy() and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        worker = state.worker
        if busy():
            log.warning(
                "shutdown timeout (%g s) passed: ending %d request(s) with a 503 / an error event",
                self.shutdown_timeout,
                worker.in_flight if worker is not None else 0,
            )
        if worker is not None:
            worker.fail_all()  # also answers requests still being prepared, once they reach the worker
        deadline = loop.time() + FLUSH_S
        while busy() and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        log.info("drained: shutting down")


_TRUE = ("1", "true", "yes", "on")


def _wants_json(argv: Sequence[str]) -> bool:
    """Whether --log-json was asked for, read from the raw flags, environment and YAML config (the settings did
    not parse; same precedence)."""
    flags = [a for a in argv if a in ("--log-json", "--no-log-json")]
    if flags:
        return flags[-1] == "--log-json"
    env = os.environ.get("DFLASH_LOG_JSON")
    if env is not None:
        return env.strip().lower() in _TRUE
    config = os.environ.get("DFLASH_CONFIG")
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            config = argv[i + 1]
        elif arg.startswith("--config="):
            config = arg.partition("=")[2]
    if not config:
        return False
    try:
        data = read_yaml(config)
    except (ValueError, OSError):
        return False
    value = data.get("log_json") if isinstance(data, dict) else None
    return value is True or str(value).strip().lower() in _TRUE


def build_server(app: Any, settings: Settings) -> DflashServer:
    """uvicorn's server for ``app`` as ``dflash-serve`` runs it: the header timeout, the connection limit, the drain
    (``app.state.dflash`` is the app's ``ServerState``). Request bodies are bounded by ``server.checks.read_body``."""
    server: DflashServer | None = None
    config = uvicorn.Config(
        ConnectionLimit(app, settings.limit_concurrency, lambda: server.server_state),  # type: ignore[union-attr]
        host=settings.host,
        port=settings.port,
        http=http_protocol(settings.header_timeout),
        log_config=None,
        log_level=settings.log_level.lower(),
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]  # a float works
        timeout_graceful_shutdown=int(FLUSH_S),
        access_log=settings.log_level.lower() == "debug",
    )
    server = DflashServer(config, app.state.dflash, settings.shutdown_timeout)
    return server


# --- main ----------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGTERM / SIGINT: 0 after a drain, 1 when the models cannot load, 2 on bad settings."""
    # Until uvicorn runs, a signal ends the process at once (as PID 1 in a container, an unhandled SIGTERM
    # would be ignored).
    signal.signal(signal.SIGTERM, _exit_now)
    signal.signal(signal.SIGINT, _exit_now)
    try:
        settings: Settings = resolve_settings(argv)
    except (ValueError, TypeError, OSError) as e:
        message = " ".join(str(e).split())
        if _wants_json(sys.argv[1:] if argv is None else argv):
            setup_logging("info", json_format=True)
            log.error("invalid settings: %s", message)
        else:
            print(f"dflash-serve: error: {message}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_json)
    log.info("settings: %s", settings.public_dict())
    problem = preflight(settings)
    if problem is not None:
        log.error("%s", problem)
        return 1
    _raise_open_files_limit(settings.limit_concurrency)

    failed: list[str] = []
    server: DflashServer | None = None

    def on_load_error(message: str) -> None:  # logged by the app, in one line
        failed.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_load_error=on_load_error)
    state: ServerState = app.state.dflash
    # SIGHUP reads the draft folder again and swaps it in (a thread: loading takes time; never the handler's)
    signal.signal(signal.SIGHUP, lambda signum, frame: threading.Thread(
        target=affinity.unpinned(state.reload_draft), name="dflash-sighup", daemon=True).start())
    server = build_server(app, settings)
    server.run()  # installs DflashServer.handle_exit while it serves, then restores _exit_now
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
