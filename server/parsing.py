"""Request bodies parsed without stalling the server, and a bound on CPU-heavy request preparation.

JSON parsing and pydantic validation hold the GIL from start to end: in a thread they stop the event loop and
the engine thread all the same (an 8 MiB ``{"prompt": [[5], [5], ...]}`` takes seconds). Small bodies are cheap
and parsed in place; a body that is big, or has many JSON values (counted from its commas and brackets, an upper
bound), goes to a helper process (``python -m server.parsing``) that parses and validates it and sends the
request object back pickled. Token-id prompts that cannot fit the context are refused in the helper, so what
comes back is bounded by what can run. Helpers start on first use, at most ``PARSE_PROCESSES`` at once, at a
lower CPU priority than the server, in the package's parent folder (so that ``-m server.parsing`` finds this
package, never a ``server/`` folder where the server was started). A helper that has died is replaced (once per
parse, even mid-exchange); one that takes over ``PARSE_TIMEOUT_S`` is killed and the client gets a 503. At most
``PARSE_MAX_BYTES`` of bodies are with the helpers at once (parsing or waiting for one; a 429 beyond): a parse
holds several times its body in memory, in the helper and in the server. After a big parse a helper gives its memory
back to the system (a collection, then ``malloc_trim``), and one grown past ``HELPER_MAX_RSS`` exits. What a
helper writes to stderr goes to the server's log, one record per line (so ``--log-json`` stays JSON).

``Limiter`` bounds work in flight (helper parses, long tokenizations): at most ``active`` at once, ``waiting``
more in line, and a 429 beyond.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import pickle
from types import TracebackType
from typing import Any

from dflash_core.grammar_checks import rss_bytes
from server.api_error import APIError, retry_later
from server.helper_process import HelperProcess, IdleHelpers, helper_streams, read_frame, write_frame
from server.protocol import AnyRequest, parse_request

log = logging.getLogger("dflash.server")

INLINE_MAX_BYTES = 256 * 1024  # bodies up to this size with few JSON values are parsed in place (about 1 ms)
INLINE_MAX_VALUES = 2000
PARSE_PROCESSES = 2
PARSE_MAX_WAITING = 64
PARSE_TIMEOUT_S = 30.0  # a helper that takes longer with one body is killed
PARSE_MAX_BYTES = 64 * 1024 * 1024  # bodies with the helpers at once (one body alone is always let through)
HELPER_TRIM_BYTES = 1024 * 1024  # after a body this big a helper frees its memory to the system
HELPER_MAX_RSS = 512 * 1024 * 1024  # a helper grown beyond this exits after its reply (the next parse starts one)
_HELPER_GONE = (ConnectionError, asyncio.IncompleteReadError)  # the helper died (killed, out of memory, ...)


class Limiter:
    """At most ``active`` holders at once and ``waiting`` more in line; beyond that, APIError 429."""

    def __init__(self, active: int, waiting: int, what: str) -> None:
        self.max_active = active
        self.max_waiting = waiting
        self.what = what
        self.active = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(active)

    async def __aenter__(self) -> Limiter:
        if self._sem.locked():
            if self.waiting >= self.max_waiting:
                raise retry_later(
                    429,
                    f"too many {self.what} in progress ({self.max_active} running, {self.waiting} waiting); "
                    "retry later",
                    "queue_full",
                )
            self.waiting += 1
            try:
                await self._sem.acquire()
            finally:
                self.waiting -= 1
        else:
            await self._sem.acquire()
        self.active += 1
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.active -= 1
        self._sem.release()


def is_cheap(body: bytes) -> bool:
    """Whether parsing ``body`` in place is cheap: small, and few JSON values (commas + brackets bound them)."""
    if len(body) > INLINE_MAX_BYTES:
        return False
    return body.count(b",") + body.count(b"[") + body.count(b"{") <= INLINE_MAX_VALUES


class _Helper(HelperProcess):
    """One ``python -m server.parsing`` process: one request at a time."""

    @classmethod
    async def start(cls) -> _Helper:
        helper = await cls.spawn("server.parsing", "parse helper")
        assert isinstance(helper, _Helper)
        return helper

    async def parse(self, kind: str, body: bytes, max_model_len: int | None) -> Any:
        await self.send(pickle.dumps((kind, max_model_len, body), protocol=pickle.HIGHEST_PROTOCOL))
        status, value = pickle.loads(await self.receive_bytes(await self.receive_size()))
        if status == "error":
            raise value
        if status != "ok":
            raise RuntimeError(f"the parse helper failed: {value}")
        return value


class ParsePool:
    """Helper processes that parse big bodies (``parse``); cheap bodies are parsed in place."""

    def __init__(self, size: int = PARSE_PROCESSES, waiting: int = PARSE_MAX_WAITING) -> None:
        self.limiter = Limiter(size, waiting, "large request bodies")
        self.bytes_in_flight = 0  # bodies parsing or waiting for a helper
        self._idle: IdleHelpers[_Helper] = IdleHelpers()

    async def _helper(self) -> _Helper:
        """An idle helper that is still alive, or a new one."""
        return self._idle.take() or await _Helper.start()

    async def parse(
        self, kind: str, body: bytes, max_model_len: int | None
    ) -> AnyRequest:
        """The validated request (APIError 400 for a bad body, 429 when too many big bodies wait, 503 when a
        helper takes over ``PARSE_TIMEOUT_S``)."""
        if is_cheap(body):
            return parse_request(kind, body, max_model_len)
        if self.bytes_in_flight and self.bytes_in_flight + len(body) > PARSE_MAX_BYTES:
            raise retry_later(
                429,
                f"too many large request bodies in progress ({self.bytes_in_flight} bytes); retry later",
                "queue_full",
            )
        self.bytes_in_flight += len(body)
        try:
            return await self._parse_big(kind, body, max_model_len)
        finally:
            self.bytes_in_flight -= len(body)

    async def _parse_big(self, kind: str, body: bytes, max_model_len: int | None) -> AnyRequest:
        """``parse`` of a body that goes to a helper."""
        async with self.limiter:
            for attempt in (1, 2):
                helper = await self._helper()
                try:
                    return await self._parse_with(helper, kind, body, max_model_len)
                except _HELPER_GONE:
                    if attempt == 2:
                        raise
                    log.warning("parse helper %d died mid-parse (%s); retrying with another", helper.proc.pid,
                                helper.proc.returncode)
        raise AssertionError("unreachable")

    async def _parse_with(self, helper: _Helper, kind: str, body: bytes, max_model_len: int | None) -> Any:
        ok = False
        try:
            result = await asyncio.wait_for(helper.parse(kind, body, max_model_len), PARSE_TIMEOUT_S)
            ok = True
        except APIError:
            ok = True  # a clean answer: the helper is in step
            raise
        except TimeoutError:
            log.warning("parse helper %d took over %.0f s with a %d-byte body: killed", helper.proc.pid,
                        PARSE_TIMEOUT_S, len(body))
            raise retry_later(
                503, f"parsing the request body took over {PARSE_TIMEOUT_S:.0f} s; retry later", "parse_timeout"
            ) from None
        finally:  # timed out, cancelled mid-exchange, or the helper died: never reused
            self._idle.release(helper, ok)
        return result

    async def close(self) -> None:
        """Stop the idle helpers (those in use are killed when their parse ends)."""
        await self._idle.close()


def main() -> None:
    """The helper process: length-prefixed pickles in on stdin, ("ok" | "error" | "failed", value) out."""
    inp, out = helper_streams()
    while (frame := read_frame(inp)) is not None:  # None: the server closed the pipe
        kind, max_model_len, body = pickle.loads(frame)
        try:
            reply: tuple[str, Any] = ("ok", parse_request(kind, body, max_model_len))
        except APIError as e:
            reply = ("error", e)
        except Exception as e:  # noqa: BLE001 - reported to the server, which logs it
            reply = ("failed", f"{type(e).__name__}: {e}")
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        write_frame(out, data)
        big = len(body) >= HELPER_TRIM_BYTES
        del reply, data, body, frame  # the frame too: its bytes are the body's size
        if big and give_back_memory() > HELPER_MAX_RSS:
            return  # the server starts another helper for the next parse


def give_back_memory() -> int:
    """Free what the last work left (Python's garbage, then glibc's free pages back to the system, which Python's
    allocator does not do by itself); this process's resident bytes after."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes()


if __name__ == "__main__":
    main()
