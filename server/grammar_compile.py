"""A chat request's grammar tried in a helper process before the server compiles it, so that what llguidance does
with client input costs only that request.

llguidance is native code: a schema can crash it (SIGSEGV: integer bounds near -2^63), or compile for a minute,
and in the server's process either would take every stream down or hold a preparation thread past its client.
A helper (``python -m server.grammar_compile``) builds the request's constraint exactly as the server would
(``server.constraints.structured_output``), compiles it with the same tokenizer, and walks its first tokens
(``dflash_core.grammar_checks.probe``); the server compiles it for the engine only once a helper has. A helper
that crashes, or takes over ``--grammar-compile-timeout`` seconds, is killed and the request gets a 400; one whose
client disconnects is killed at once (identical checks running at once share one helper run, stopped only when
all their clients have left). A helper killed by a signal from outside (SIGKILL from the OOM killer, SIGTERM) is
no verdict on the grammar: the check is retried once on a fresh helper, and only a crash signal that repeats there
is remembered as a refusal. Outcomes are remembered (``CHECKED_KEEP`` constraints; a timeout for
``TIMEOUT_KEEP_S``), so a repeated constraint never waits for a helper again; a grammar the server has compiled
already is not checked again. Replies come back as size-capped JSON (``REPLY_MAX_BYTES``), never unpickled.

Helpers start on first use (each reads the tokenizer once), at most ``GRAMMAR_PROCESSES`` at once, at a lower CPU
priority than the server; one that has grown over ``HELPER_MAX_RSS`` is replaced.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import pickle
import signal
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from dflash_core.grammar import LLGuidanceBackend, StructuredOutput
from dflash_core.grammar_checks import TokenizerSource, probe, short_error
from server import affinity
from server.api_error import APIError, retry_later
from server.chat_request import ChatCompletionRequest
from server.helper_process import HelperProcess, IdleHelpers, helper_streams, read_frame, write_frame
from server.parsing import Limiter, give_back_memory

log = logging.getLogger("dflash.server")

GRAMMAR_PROCESSES = 2
GRAMMAR_MAX_WAITING = 64
DEFAULT_TIMEOUT_S = 30.0
HELPER_START_S = 120.0  # reading a large tokenizer takes a second or so; far beyond that the helper is broken
HELPER_MAX_RSS = 1024**3  # a helper grown beyond this after a check is replaced (its memory back to the system)
CHECKED_KEEP = 4096  # constraints whose outcome is remembered
TIMEOUT_KEEP_S = 600.0  # how long a constraint that timed out is refused without trying it again
REPLY_MAX_BYTES = 64 * 1024  # a helper's reply (status, message, retire) as JSON; anything longer is a broken helper
REPLY_VALUE_CHARS = 4000  # the helper cuts its messages to this
# signals a crash in native code dies of (a grammar that does this twice is refused for good); others come from outside
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})
_HELPER_GONE = (ConnectionError, asyncio.IncompleteReadError, BrokenPipeError)


class _BadReply(RuntimeError):
    """A helper's reply is too long or not the JSON (status, message, retire) it sends."""


def needs_grammar(req: ChatCompletionRequest) -> bool:
    """Whether ``req`` is constrained by a grammar (a forced tool call or a response_format)."""
    return req.forced_tool() or req.response_format is not None and req.response_format.type != "text"


def _param(req: ChatCompletionRequest) -> str:
    return "tools" if req.forced_tool() else "response_format"


def _constraint_fields(req: ChatCompletionRequest) -> ChatCompletionRequest:
    """``req`` without what its constraint does not depend on (the messages can be megabytes)."""
    return req.model_copy(update={"messages": []})


def _key(req: ChatCompletionRequest, style: str) -> str:
    """A digest of what ``req``'s constraint is built from."""
    fields = req.model_dump(include={"tools", "tool_choice", "parallel_tool_calls", "response_format"},
                            exclude_none=True, by_alias=True)
    return hashlib.sha256(json.dumps([fields, style], sort_keys=True, default=str).encode()).hexdigest()


class _Helper(HelperProcess):
    """One ``python -m server.grammar_compile`` process: one check at a time."""

    @classmethod
    async def start(cls, source: TokenizerSource) -> _Helper:
        helper = await cls.spawn("server.grammar_compile", "grammar helper")
        assert isinstance(helper, _Helper)
        try:
            status, value, _ = await asyncio.wait_for(helper.exchange(source), HELPER_START_S)
        except TimeoutError:
            helper.kill()
            raise RuntimeError(f"no reply within {HELPER_START_S:g} s of its start (reading the tokenizer)") from None
        except _HELPER_GONE:
            helper.kill()
            raise RuntimeError(f"it ended while reading the tokenizer ({await helper.died()})") from None
        except BaseException:
            helper.kill()
            raise
        if status != "ready":
            helper.kill()
            raise RuntimeError(f"the grammar helper did not start: {value}")
        return helper

    async def exchange(self, message: Any) -> tuple[str, str | None, bool]:
        """Send ``message`` (pickled: the server's own objects, to the helper), return the reply (status, message,
        retire) read as JSON of at most REPLY_MAX_BYTES; a _HELPER_GONE error when the helper dies meanwhile,
        _BadReply when its reply is not such JSON."""
        await self.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        size = await self.receive_size()
        if size > REPLY_MAX_BYTES:
            raise _BadReply(f"a {size}-byte reply (the most is {REPLY_MAX_BYTES})")
        return _read_reply(await self.receive_bytes(size))


def _read_reply(data: bytes) -> tuple[str, str | None, bool]:
    """A helper's reply: JSON [status, message or null, retire]; _BadReply for anything else."""
    try:
        status, value, retire = json.loads(data)
    except (ValueError, TypeError) as e:
        raise _BadReply(f"an unreadable reply ({e})") from None
    if not isinstance(status, str) or not (value is None or isinstance(value, str)) or not isinstance(retire, bool):
        raise _BadReply("a reply that is not [status, message, retire]")
    return status, value, retire


@dataclass(frozen=True)
class _Refusal:
    """Why a constraint cannot be used; ``keep_s``: for how long the same constraint is refused again without a
    helper (inf: for good; 0: tried again next time, such as after a helper killed from outside)."""

    message: str
    keep_s: float = math.inf


@dataclass
class _Running:
    """A check in progress and how many requests wait on it."""

    work: asyncio.Future[_Refusal | None]
    waiters: int = 0


class GrammarChecks:
    """Helper processes that try chat requests' constraints (``check``) before the server compiles them."""

    def __init__(self, backend: LLGuidanceBackend, timeout_s: float = DEFAULT_TIMEOUT_S,
                 size: int = GRAMMAR_PROCESSES, waiting: int = GRAMMAR_MAX_WAITING) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.limiter = Limiter(size, waiting, "grammar compiles")
        self._source: TokenizerSource | None = None
        self._idle: IdleHelpers[_Helper] = IdleHelpers()
        # digest -> (None (fine) or the 400, until when it holds (loop time))
        self._outcomes: OrderedDict[str, tuple[_Refusal | None, float]] = OrderedDict()
        self._running: dict[str, _Running] = {}  # digest -> the check in progress

    async def check(self, req: ChatCompletionRequest, style: str, request: Any = None) -> None:
        """Nothing when ``req``'s constraint compiles and runs its first tokens in a helper; else APIError 400
        naming the problem (a crash and a timeout included). ``request``: the client's Starlette request, whose
        disconnect stops its wait (and the check, once no other request waits on it)."""
        if not needs_grammar(req):
            return
        key = _key(req, style)
        known = self._outcomes.get(key)
        if known is not None and known[1] > asyncio.get_running_loop().time():
            self._outcomes.move_to_end(key)
            self._raise(req, known[0])
            return
        running = self._running.get(key)
        if running is None:
            running = self._running[key] = _Running(asyncio.ensure_future(self._check(req, style)))
            running.work.add_done_callback(lambda work: self._finished(key, work))
        running.waiters += 1
        try:
            if request is None:
                outcome = await asyncio.shield(running.work)
            else:
                outcome = await _unless_disconnected(running.work, request)
        finally:
            running.waiters -= 1
            if running.waiters == 0 and not running.work.done():  # nobody left to answer: the helper is killed
                running.work.cancel()
                if self._running.get(key) is running:  # a request coming next starts a check of its own
                    del self._running[key]
                log.info("client disconnected while its grammar compiled: compile stopped")
        self._raise(req, outcome)

    def _finished(self, key: str, work: asyncio.Future[_Refusal | None]) -> None:
        """Remember ``work``'s outcome (once, whoever waited on it)."""
        if self._running.get(key) is not None and self._running[key].work is work:
            del self._running[key]
        if work.cancelled() or work.exception() is not None:
            return
        outcome = work.result()
        keep_s = math.inf if outcome is None else outcome.keep_s
        if keep_s > 0:
            self._outcomes[key] = (outcome, asyncio.get_running_loop().time() + keep_s)
            self._outcomes.move_to_end(key)
            while len(self._outcomes) > CHECKED_KEEP:
                self._outcomes.popitem(last=False)

    @staticmethod
    def _raise(req: ChatCompletionRequest, outcome: _Refusal | None) -> None:
        if outcome is not None:
            param = _param(req)
            text = outcome.message
            raise APIError(400, text if text.startswith(f"{param}:") else f"{param}: {text}", param=param)

    async def _check(self, req: ChatCompletionRequest, style: str) -> _Refusal | None:
        """None when the constraint can be used, else why not. A helper that dies is replaced and the check tried
        once more: a refusal is lasting only when both die of a crash signal (one killed from outside, by the OOM
        killer say, is no verdict on the grammar)."""
        async with self.limiter:
            deaths: list[int] = []
            while True:
                helper = await self._started_helper()
                if isinstance(helper, _Refusal):
                    return helper
                ok = False
                try:
                    status, value, retire = await asyncio.wait_for(
                        helper.exchange((_constraint_fields(req), style)), self.timeout_s)
                    ok = not retire
                    break
                except TimeoutError:
                    log.warning("grammar helper %d: the %s constraint took over %g s: killed", helper.proc.pid,
                                _param(req), self.timeout_s)
                    return _Refusal(f"the grammar did not compile within {self.timeout_s:g} s "
                                    "(--grammar-compile-timeout); simplify the schema", keep_s=TIMEOUT_KEEP_S)
                except _BadReply as e:
                    log.error("grammar helper %d sent %s on a %s constraint: killed", helper.proc.pid, e,
                              _param(req))
                    return _Refusal("the grammar compiler failed on this grammar", keep_s=0)
                except _HELPER_GONE:
                    how = await helper.died()
                    deaths.append(helper.proc.returncode or 0)
                    again = len(deaths) == 1
                    log.warning("grammar helper %d died (%s) compiling a %s constraint: %s", helper.proc.pid, how,
                                _param(req), "retrying with another" if again else "the request gets a 400")
                    if not again:
                        crashed = all(-code in CRASH_SIGNALS for code in deaths)
                        return _Refusal(f"the grammar crashed the grammar compiler ({how}); it cannot be used",
                                        keep_s=math.inf if crashed else 0)
                finally:  # a timeout, a cancel or a death: never reused
                    self._idle.release(helper, ok)
        if status == "ok":
            return None
        if status != "error":  # an unexpected failure on this input: still the request's, never the server's
            log.warning("grammar helper %d failed on a %s constraint: %s", helper.proc.pid, _param(req), value)
            return _Refusal(f"the grammar could not be compiled: {value}")
        return _Refusal(str(value))

    async def _started_helper(self) -> _Helper | _Refusal:
        """``_helper``; the refusal when llguidance cannot read the tokenizer; a 503 when no helper starts."""
        try:
            return await self._helper()
        except ValueError as e:  # the tokenizer cannot be read by llguidance: no grammar for anyone
            return _Refusal(str(e))
        except (OSError, RuntimeError, TimeoutError, *_HELPER_GONE) as e:
            log.error("a grammar helper did not start: %s", str(e) or type(e).__name__)
            unavailable = retry_later(503, "the grammar compiler is unavailable; retry later", "no_grammar")
            raise unavailable from None

    async def _helper(self) -> _Helper:
        """An idle helper that is still alive, or a new one."""
        idle = self._idle.take()
        if idle is not None:
            return idle
        if self._source is None:
            self._source = await asyncio.to_thread(affinity.unpinned(self.backend.tokenizer_source))
        return await _Helper.start(self._source)

    async def close(self) -> None:
        """Stop the idle helpers (those in use are killed when their check ends)."""
        await self._idle.close()


async def _unless_disconnected(work: asyncio.Future[_Refusal | None], request: Any) -> _Refusal | None:
    """``work``'s result; APIError 400 (which nobody reads) when the client disconnects first. ``work`` goes on:
    other requests may wait on it (``GrammarChecks.check`` stops it when none does)."""
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work in done:
        return work.result()
    raise APIError(400, "the client disconnected while its grammar compiled", code="client_disconnected")


async def _disconnect(request: Any) -> None:
    """Returns when the client has disconnected (the body was read already: only the disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the helper process ----
def _compile_and_probe(tokenizer: Any, req: ChatCompletionRequest, style: str) -> None:
    """``req``'s constraint built, compiled and walked (APIError or ValueError naming the problem)."""
    from llguidance import LLMatcher

    from dflash_core.grammar import _llguidance_grammar
    from server.constraints import structured_output

    structured: StructuredOutput | None = structured_output(req, style, None)
    if structured is None:
        return
    grammar = _llguidance_grammar(structured)
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"{structured.kind} does not compile: {short_error(matcher.get_error())}")
    try:
        probe(matcher, set(tokenizer.eos_tokens))
    except ValueError as e:
        raise ValueError(f"{structured.kind} cannot be used: {e}") from None


def _reply(out: Any, status: str, value: str | None, retire: bool = False) -> None:
    """JSON [status, value, retire]: retire tells the server that this helper exits now (it starts another)."""
    if value is not None and len(value) > REPLY_VALUE_CHARS:
        value = value[:REPLY_VALUE_CHARS] + "..."
    write_frame(out, json.dumps([status, value, retire]).encode())


def main() -> None:
    """The helper: a TokenizerSource, then (request, style) checks, as length-prefixed pickles from the server;
    length-prefixed JSON replies."""
    inp, out = helper_streams()
    tokenizer = None
    while (frame := read_frame(inp)) is not None:  # None: the server closed the pipe
        message = pickle.loads(frame)
        if tokenizer is None:
            tokenizer = message.build()
            _reply(out, "ready", None)
            continue
        try:
            _compile_and_probe(tokenizer, *message)
            status, value = "ok", None
        except APIError as e:
            status, value = "error", e.message
        except ValueError as e:
            status, value = "error", str(e)
        except Exception as e:  # noqa: BLE001 - reported to the server
            status, value = "failed", f"{type(e).__name__}: {e}"
        retire = give_back_memory() > HELPER_MAX_RSS
        _reply(out, status, value, retire)
        if retire:
            return


if __name__ == "__main__":
    main()
