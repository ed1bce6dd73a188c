"""A helper process of the server (``python -m <module>``, started on every core the server has, whatever
``--one-core`` pinned: ``server/affinity.py``): what the body parsers (``server/parsing.py``) and the
grammar checkers (``server/grammar_compile.py``) share. Messages are length-prefixed frames on the helper's
stdin / stdout; its stderr goes to the log line by line; it runs in its own session (a Ctrl+C in the server's
terminal is the server's to handle, not the helper's mid-work) from the package's parent folder, so that
``-m server.<module>`` finds us."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Generic, TypeVar

from server import affinity

log = logging.getLogger("dflash.server")

HEADER_BYTES = 8  # the length prefix of each frame
HELPER_NICE = 10  # a helper yields the CPU to the server (a hostile body must not slow everyone's tokens)
STDERR_LINE_CHARS = 2000
_PACKAGE_PARENT = Path(__file__).resolve().parent.parent


class HelperProcess:
    """One helper process, one message at a time: ``send`` a frame, ``receive`` a frame."""

    def __init__(self, proc: asyncio.subprocess.Process, label: str) -> None:
        self.proc = proc
        self.label = label
        self._stderr = asyncio.create_task(self._log_stderr())
        self._reaper: asyncio.Task[None] | None = None

    @classmethod
    async def spawn(cls, module: str, label: str) -> HelperProcess:
        with affinity.spawning():  # not on the core `--one-core` gave this thread and the worker
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", module,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,  # read line by line into the log (_log_stderr), never left to fill
                cwd=_PACKAGE_PARENT, start_new_session=True,
            )
        return cls(proc, label)

    @property
    def alive(self) -> bool:
        """Not known to have exited."""
        return self.proc.returncode is None

    async def _log_stderr(self) -> None:
        assert self.proc.stderr is not None
        with contextlib.suppress(Exception):
            async for line in self.proc.stderr:
                text = line.decode(errors="replace").rstrip()
                if text:
                    log.warning("%s %d: %s", self.label, self.proc.pid, text[:STDERR_LINE_CHARS])

    async def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(len(data).to_bytes(HEADER_BYTES, "little") + data)
        await self.proc.stdin.drain()

    async def receive_size(self) -> int:
        """The length of the next frame (read its bytes with ``receive_bytes``)."""
        assert self.proc.stdout is not None
        return int.from_bytes(await self.proc.stdout.readexactly(HEADER_BYTES), "little")

    async def receive_bytes(self, size: int) -> bytes:
        assert self.proc.stdout is not None
        return await self.proc.stdout.readexactly(size)

    def kill(self) -> None:
        """SIGKILL, and reaped in the background (``reap_killed`` awaits what is still pending): a killed helper
        left unawaited closes its transport only when it is collected, after the loop may have closed."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
            _REAPING.add(self._reaper)
            self._reaper.add_done_callback(_REAPING.discard)

    async def _reap(self) -> None:
        """Wait for the killed helper's exit and the end of its stderr (its pipes and transport then close)."""
        with contextlib.suppress(Exception):
            await self.proc.wait()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._stderr), 1.0)

    async def died(self) -> str:
        """How the helper ended (waits for it)."""
        code = await self.proc.wait()
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    async def close(self) -> None:
        """Close its stdin (it exits at the end of its input), killed when it does not within 2 s."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 2.0)
        except TimeoutError:
            self.kill()
            await self.proc.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stderr, 1.0)
        if self._reaper is not None:
            await self._reaper


H = TypeVar("H", bound=HelperProcess)
_REAPING: set[asyncio.Task[None]] = set()  # killed helpers being reaped (held here until they are)


async def reap_killed() -> None:
    """Wait until every helper killed so far on this loop has exited and its pipes have closed."""
    loop = asyncio.get_running_loop()
    pending = [t for t in _REAPING if t.get_loop() is loop]
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


class IdleHelpers(Generic[H]):
    """A pool's idle helpers: one is reused while it is alive and was left in step, killed otherwise."""

    def __init__(self) -> None:
        self._helpers: list[H] = []
        self.closed = False

    def take(self) -> H | None:
        """An idle helper that is still alive (one that exited meanwhile is logged and dropped), or None."""
        while self._helpers:
            helper = self._helpers.pop()
            if helper.alive:
                return helper
            log.warning("%s %d exited (%s) while idle; starting another", helper.label, helper.proc.pid,
                        helper.proc.returncode)
            helper.kill()  # already gone: reaped in the background like a killed one
        return None

    def release(self, helper: H, in_step: bool) -> None:
        """Back to the idle ones when it answered in step; killed otherwise (a timeout, a cancel, a death)."""
        if in_step and not self.closed and helper.alive:
            self._helpers.append(helper)
        else:
            helper.kill()

    async def close(self) -> None:
        """Stop the idle helpers (those in use are killed when they are released)."""
        self.closed = True
        helpers, self._helpers = self._helpers, []
        for helper in helpers:
            await helper.close()
        await reap_killed()

    def __len__(self) -> int:
        return len(self._helpers)

    def __iter__(self) -> Iterator[H]:
        return iter(self._helpers)


def read_frame(inp: BinaryIO) -> bytes | None:
    """In the helper: the next frame from the server, None at the end of its input."""
    head = inp.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES:
        return None
    return inp.read(int.from_bytes(head, "little"))


def write_frame(out: BinaryIO, data: bytes) -> None:
    """In the helper: one frame to the server."""
    out.write(len(data).to_bytes(HEADER_BYTES, "little") + data)
    out.flush()


def helper_streams() -> tuple[BinaryIO, BinaryIO]:
    """In the helper, at its start: (frames in, frames out). Anything printed goes to stderr, never into the
    replies, and the helper runs at a lower CPU priority than the server."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    with contextlib.suppress(OSError):
        os.nice(HELPER_NICE)
    return sys.stdin.buffer, out
