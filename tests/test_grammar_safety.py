"""Client grammars cannot hurt the server: a schema that crashes llguidance, one that allows no finite value, one
that fails on its first tokens or one that compiles for too long is a 400 before any token, and the server goes on
serving; a compile stops when its client leaves; the compiled-grammar cache is bounded by bytes; big bodies being
parsed are bounded by bytes and their helpers give the memory back.

The server tests run a real ``python -m server`` on the bundled demo target with the real ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from dflash_core.grammar import LLGuidanceBackend, StructuredOutput
from dflash_core.grammar_checks import check_schema
from dflash_core.loading import DEMO_TARGET
from server import grammar_compile
from server.api_error import APIError
from server.chat_request import ChatCompletionRequest
from server.grammar_compile import GrammarChecks, _Helper
from server.parsing import PARSE_MAX_BYTES, ParsePool
from tests.server_fixtures import ServerProcess, start_server

MODEL = "dflash-demo"
TIMEOUT_S = 8  # the test server's --grammar-compile-timeout
SHORT_TIMEOUT_S = 0.1  # the timeout test server's
# llguidance 1.x dies with SIGSEGV on this integer range (bounds inside int64, near -2^63)
CRASHING = {"type": "integer", "minimum": -9223372036854775807, "maximum": -9223372036854775807}
BEYOND_INT64 = {"type": "integer", "minimum": 1e19, "maximum": 1e19}
REF_ROOT = {"$ref": "#"}
DEFS_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
REQUIRED_SELF = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}


def optional_props(n: int, prefix: str = "p") -> dict[str, Any]:
    """An object of `n` optional integer properties (llguidance: over ~500 fails on the first key, and 8,000
    compile for tens of seconds)."""
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(n)}}


def required_props(n: int) -> dict[str, Any]:
    """A valid object of `n` required properties (llguidance, quadratic: 6,000 compile in about 0.4 s, 12,500
    (241 KB, under the 256 KiB a request's schemas may hold) in 1 to 2.5 s)."""
    names = [f"{i:x}" for i in range(n)]
    return {"type": "object", "properties": {k: {} for k in names}, "required": names}


# ---- the schema checks and the backend, in-process ----
@pytest.fixture(scope="module")
def backend() -> LLGuidanceBackend:
    tok = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    return LLGuidanceBackend(tok, len(tok))


@pytest.mark.parametrize("schema", [
    BEYOND_INT64,
    {"type": "integer", "minimum": -1e19, "maximum": -1e19},
    {"type": ["integer", "null"], "maximum": 2**63},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": -1e300}}},
])
def test_integer_bounds_beyond_int64_do_not_compile(backend: LLGuidanceBackend, schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="outside the 64-bit integer range"):
        backend.compile(StructuredOutput("json_schema", schema))


@pytest.mark.parametrize("schema", [REF_ROOT, DEFS_CYCLE, REQUIRED_SELF,
                                    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
                                    {"anyOf": [{"$ref": "#"}, False]}],
                         ids=["ref-root", "defs-cycle", "required-self", "array-self", "anyof-self"])
def test_schemas_without_a_finite_value_do_not_compile(backend: LLGuidanceBackend, schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="no finite value"):
        backend.compile(StructuredOutput("json_schema", schema))


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}, "required": ["children"]},
    {"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                            {"type": "null"}]}},
                        "required": ["next"]}}, "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"x": {"$ref": "#"}}},
    {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
], ids=["tree", "linked-list", "optional-self", "int64-range"])
def test_recursive_schemas_with_a_way_out_and_int64_bounds_compile(
    backend: LLGuidanceBackend, schema: dict[str, Any]
) -> None:
    check_schema(schema)
    backend.compile(StructuredOutput("json_schema", schema))


def test_a_grammar_that_allows_nothing_is_an_error_when_it_compiles(backend: LLGuidanceBackend) -> None:
    # check_schema is conservative; a grammar llguidance finds empty is caught by the first mask, at compile time
    with pytest.raises(ValueError, match="allows no output"):
        backend.compile(StructuredOutput("lark", "start: a\na: a \"x\"\n"))


def test_the_compiled_grammar_cache_is_bounded_by_bytes() -> None:
    tok = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    probe = LLGuidanceBackend(tok, len(tok))
    probe.compile(StructuredOutput("json_schema", optional_props(300, "probe")))
    one = probe.cached_bytes
    bound = int(2.5 * one)
    small = LLGuidanceBackend(tok, len(tok), cache_bytes=bound)
    for i in range(6):
        small.compile(StructuredOutput("json_schema", optional_props(300, f"k{i}_")))
        assert small.cached_bytes <= bound
    assert small.cached_bytes > 0
    tiny = LLGuidanceBackend(tok, len(tok), cache_bytes=1)  # an entry alone over the bound is not kept
    tiny.compile(StructuredOutput("json_schema", optional_props(10)))
    assert tiny.cached_bytes == 0


def test_a_precompiled_matchers_first_mask_is_the_grammars(backend: LLGuidanceBackend) -> None:
    structured = backend.precompile(StructuredOutput("json_schema", {"enum": ["ab", "cd"]}), copies=2)
    eos = backend.tokenizer.eos_token_id
    first = backend.matcher(structured, [eos])
    fresh = backend.compile(StructuredOutput("json_schema", {"enum": ["ab", "cd"]})).matcher([eos])
    allowed = first.allowed()
    assert allowed.any() and allowed.tolist() == fresh.allowed().tolist()
    token = int(allowed.nonzero()[0])
    assert first.accept(token)
    after = first.allowed()
    first.rollback(1)
    assert first.allowed().tolist() == allowed.tolist() and after.tolist() != allowed.tolist()


# ---- a real server ----
def demo_server(tmp_path_factory: pytest.TempPathFactory, name: str, timeout_s: float) -> Iterator[ServerProcess]:
    """A plain demo server whose grammars may compile for ``timeout_s`` seconds, stopped after the module."""
    log = tmp_path_factory.mktemp(name) / "server.log"
    srv = start_server(["--model", str(DEMO_TARGET), "--no-speculative", "--device", "cpu",
                        "--grammar-compile-timeout", str(timeout_s)], log)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.terminate()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from demo_server(tmp_path_factory, "grammar_safety", TIMEOUT_S)


def client(server: ServerProcess, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=timeout, max_retries=0)


def with_schema(c: openai.OpenAI, schema: Any, stream: bool = False, max_tokens: int = 12) -> Any:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give a number."}],
                                     response_format=fmt, max_tokens=max_tokens, temperature=0, stream=stream)


def assert_works(server: ServerProcess) -> None:
    """A structured request still completes, its output following its schema."""
    out = with_schema(client(server), {"type": "integer", "minimum": 1, "maximum": 9})
    assert 1 <= int(out.choices[0].message.content) <= 9
    assert server.proc.poll() is None


def test_a_schema_that_crashes_llguidance_is_a_400_and_the_server_serves_on(server: ServerProcess) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            with_schema(client(server), CRASHING, stream=stream)
        assert err.value.status_code == 400
        assert err.value.body["param"] == "response_format" and "crashed" in err.value.body["message"]
        assert_works(server)
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": CRASHING}, "required": ["n"]}}}
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick."}],
                                               tools=[tool], tool_choice="required", max_tokens=20)
    assert err.value.body["param"] == "tools"
    assert_works(server)


@pytest.mark.parametrize(("schema", "says"), [
    (BEYOND_INT64, "outside the 64-bit integer range"),
    (REF_ROOT, "no finite value"),
    (DEFS_CYCLE, "no finite value"),
    (REQUIRED_SELF, "no finite value"),
    (optional_props(600), "max is 2000"),
], ids=["int-beyond-int64", "ref-root", "defs-cycle", "required-self", "600-optional"])
def test_bad_grammars_are_400s_before_any_token(server: ServerProcess, schema: Any, says: str) -> None:
    for stream in (True, False):
        with pytest.raises(openai.BadRequestError) as err:
            with_schema(client(server), schema, stream=stream)  # a stream raises before its first chunk
        body = err.value.body
        assert body["type"] == "invalid_request_error" and body["param"] == "response_format"
        assert says in body["message"]


@pytest.fixture(scope="module")
def short_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from demo_server(tmp_path_factory, "grammar_timeout", SHORT_TIMEOUT_S)


def test_a_compile_over_the_timeout_is_a_400(short_server: ServerProcess) -> None:
    slow = required_props(12500)  # valid, and over 10x the timeout to compile on any CPU
    for _ in range(2):  # the second is refused at once: a timeout is remembered for a while
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as err:
            with_schema(client(short_server), slow)
        assert f"did not compile within {SHORT_TIMEOUT_S} s" in err.value.body["message"]
        assert time.monotonic() - start < 20
    assert short_server.log_tail(20000).count("took over") == 1
    out = client(short_server).chat.completions.create(model=MODEL, max_tokens=2,
                                                        messages=[{"role": "user", "content": "Hi"}])
    assert out.choices[0].finish_reason and short_server.proc.poll() is None


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` (with its reaped children) and of its live children."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(p: int) -> list[str]:
        text = Path(f"/proc/{p}/stat").read_text()
        return text[text.rindex(")") + 2:].split()

    fields = stat(pid)
    total = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                child = stat(int(entry.name))
            except (OSError, ValueError):
                continue
            if int(child[1]) == pid:
                total += int(child[11]) + int(child[12])
    return total / tick


def test_a_compile_stops_when_its_client_leaves(server: ServerProcess) -> None:
    def abandon(i: int) -> None:
        with pytest.raises(openai.APITimeoutError):
            with_schema(client(server, timeout=1.0), optional_props(8000, f"g{i}"))

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(abandon, range(2)))
    time.sleep(1.0)  # the server sees the disconnects and reaps the helpers it killed
    before = _tree_cpu_s(server.proc.pid)
    time.sleep(3.0)
    spent = _tree_cpu_s(server.proc.pid) - before
    assert spent < 1.0, f"the server spent {spent:.1f} CPU s after its clients left"  # two compiles: ~2 per s
    assert "compile stopped" in server.log_tail(20000)
    assert_works(server)


# ---- parse helpers ----
def _big_body(i: int) -> bytes:
    """A 7.2 MB body of 64 token-id prompts that needs a parse helper."""
    return json.dumps({"model": "m", "prompt": [[12345 + i + j % 7 for j in range(16000)] for _ in range(64)],
                       "max_tokens": 1}).encode()


def _helper_rss() -> list[int]:
    """Resident bytes of this process's parse helpers."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"server.parsing" not in (entry / "cmdline").read_bytes():
                continue
            status = (entry / "status").read_text()
            ppid = int(status.split("PPid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid():
            out.append(int(status.split("VmRSS:")[1].split()[0]) * 1024)
    return out


CONTEXT = 40_000  # the prompts fit: the helper parses them whole and sends them back


def test_big_bodies_being_parsed_are_bounded_by_bytes_and_helpers_give_memory_back() -> None:
    async def run() -> tuple[list[Any], list[int], list[int]]:
        pool = ParsePool()
        try:
            with pytest.raises(APIError):  # start the helpers, their baseline
                await pool.parse("completion", json.dumps({"junk": list(range(3000))}).encode(), 4096)
            baseline = _helper_rss()
            bodies = [_big_body(i) for i in range(PARSE_MAX_BYTES // len(_big_body(0)) + 4)]
            results = await asyncio.gather(*(pool.parse("completion", b, CONTEXT) for b in bodies),
                                           return_exceptions=True)
            await asyncio.sleep(1.0)  # the helpers free their memory after replying
            return results, baseline, _helper_rss()
        finally:
            await pool.close()

    results, baseline, after = asyncio.run(run())
    refused = [e.status for e in results if isinstance(e, APIError)]
    parsed = [r for r in results if not isinstance(r, BaseException)]
    assert refused and set(refused) == {429} and len(parsed) + len(refused) == len(results)
    assert 0 < len(parsed) * len(_big_body(0)) <= PARSE_MAX_BYTES + len(_big_body(0))
    assert after and max(after) < max(baseline) + 4 * 1024 * 1024, (baseline, after)  # kept: ~10 MB per body


# ---- the grammar checks, in-process ----
def chat(schema: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})


class Client:
    """A Starlette request's receive(): the client disconnects after `leave_s` (never when None)."""

    def __init__(self, leave_s: float | None = None) -> None:
        self.leave_s = leave_s

    async def receive(self) -> dict[str, str]:
        await asyncio.sleep(1e9 if self.leave_s is None else self.leave_s)
        return {"type": "http.disconnect"}


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Counts the helpers' checks (``n``); ``kills``: signals sent to the helper as each next check starts."""
    seen: dict[str, Any] = {"n": 0, "kills": []}
    exchange = _Helper.exchange

    async def counted(self: _Helper, message: Any) -> Any:
        if isinstance(message, tuple):
            seen["n"] += 1
            if seen["kills"]:
                os.kill(self.proc.pid, seen["kills"].pop(0))
                await self.proc.wait()
        return await exchange(self, message)

    monkeypatch.setattr(_Helper, "exchange", counted)
    return seen


async def _outcome(checks: GrammarChecks, schema: Any, request: Any = None) -> str:
    """"ok", or the APIError's status and message."""
    try:
        await checks.check(chat(schema), "hermes", request)
    except APIError as e:
        return f"{e.status} {e.message}"
    return "ok"


def test_a_helper_killed_from_outside_is_retried_and_never_remembered(backend: LLGuidanceBackend,
                                                                    runs: dict[str, Any]) -> None:
    async def go() -> None:
        checks = GrammarChecks(backend, timeout_s=60)
        try:
            runs["kills"] = [signal.SIGKILL]  # the OOM killer, say: the check goes on with a fresh helper
            assert await _outcome(checks, required_props(18)) == "ok" and runs["n"] == 2
            assert await _outcome(checks, required_props(18)) == "ok" and runs["n"] == 2  # remembered
            runs["kills"] = [signal.SIGKILL, signal.SIGTERM]  # killed twice: a 400 this time, not remembered
            assert "killed by SIGTERM" in await _outcome(checks, required_props(19))
            assert await _outcome(checks, required_props(19)) == "ok" and runs["n"] == 5
            said = await _outcome(checks, CRASHING)  # a crash that repeats on the retry is remembered
            assert "crashed" in said and "SIGSEGV" in said and runs["n"] == 7
            assert await _outcome(checks, CRASHING) == said and runs["n"] == 7
        finally:
            await checks.close()

    asyncio.run(go())


def test_identical_checks_share_one_helper_run_and_a_timeout_is_remembered(backend: LLGuidanceBackend,
                                                                          runs: dict[str, Any]) -> None:
    slow = required_props(12500)

    async def go() -> None:
        checks = GrammarChecks(backend, timeout_s=0.1)
        try:
            await _outcome(checks, {"type": "integer"})  # a helper started
            start = time.monotonic()
            said = await asyncio.gather(*(_outcome(checks, slow) for _ in range(4)))
            assert all("did not compile within 0.1 s" in s for s in said) and runs["n"] == 2, said
            assert time.monotonic() - start < 10
            assert await _outcome(checks, slow) == said[0] and runs["n"] == 2  # no helper: refused at once
        finally:
            await checks.close()

    asyncio.run(go())


def test_a_shared_check_goes_on_until_its_last_client_leaves(backend: LLGuidanceBackend,
                                                               runs: dict[str, Any]) -> None:
    async def go() -> None:
        checks = GrammarChecks(backend, timeout_s=60)
        try:
            await asyncio.gather(_outcome(checks, {"type": "integer"}), _outcome(checks, {"type": "string"}))
            schema = required_props(6000)  # two helpers idle: the client leaving leaves its compile running
            said = await asyncio.gather(_outcome(checks, schema, Client(0.2)), _outcome(checks, schema, Client()))
            assert "client disconnected" in said[0] and said[1] == "ok" and runs["n"] == 3
            schema = required_props(12500)
            said = await asyncio.gather(_outcome(checks, schema, Client(0.05)), _outcome(checks, schema, Client(0.1)))
            assert all("client disconnected" in s for s in said)
            await asyncio.sleep(0.2)
            assert runs["n"] == 4 and len(checks._idle) == 1  # its helper killed
        finally:
            await checks.close()

    asyncio.run(go())


def test_a_helper_reply_over_the_size_cap_is_refused(backend: LLGuidanceBackend, runs: dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        checks = GrammarChecks(backend, timeout_s=60)
        try:
            await _outcome(checks, {"type": "integer"})  # the helper started (its ready reply is short)
            monkeypatch.setattr(grammar_compile, "REPLY_MAX_BYTES", 10)
            assert "failed on this grammar" in await _outcome(checks, BEYOND_INT64)
            monkeypatch.setattr(grammar_compile, "REPLY_MAX_BYTES", 64 * 1024)
            assert "outside the 64-bit" in await _outcome(checks, BEYOND_INT64)  # not remembered
        finally:
            await checks.close()

    asyncio.run(go())
    with pytest.raises(grammar_compile._BadReply):
        grammar_compile._read_reply(b"\x80\x05N.")  # a pickle: never loaded


def test_a_helper_that_does_not_start_says_why(backend: LLGuidanceBackend, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(grammar_compile, "HELPER_START_S", 0.001)

    async def go() -> None:
        checks = GrammarChecks(backend)
        try:
            assert (await _outcome(checks, {"type": "integer"})).startswith("503")
        finally:
            await checks.close()

    with caplog.at_level(logging.ERROR, logger="dflash.server"):
        asyncio.run(go())
    assert "a grammar helper did not start: no reply within" in caplog.text
