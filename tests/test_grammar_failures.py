"""Grammars at their limits never make a request sample from nothing: min_tokens yields to a grammar's end, a grammar
that cannot go on mid-output fails its request alone with a message that says so (the same way every time: a
failed matcher drops its cached grammar), llguidance's panics read as one line, and a schema's numbers are finite.

Engine tests run the bundled demo pair with and without its draft; the server tests a real ``python -m server``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
import torch

from dflash_core.grammar import GrammarState, StructuredOutput, TokenMatcher
from dflash_core.grammar_checks import GrammarFailure
from dflash_core.sampling import SamplingParams
from dflash_core.tool_grammar import tool_call_structure
from tests.demo_engines import both, demo, prompts
from tests.server_fixtures import ServerProcess, start_server

MODEL = "dflash-demo"
EOS = 2  # the demo tokenizer's <|im_end|>
LEXER_LIMIT = {"type": "string", "pattern": "^(a|b)*c{50000}$"}  # llguidance's lexer gives up on the first "c"
DEAD_END = 'start: "a" B\nB: /b{3}/ & /b{2}/\n'  # "a", then no token: the intersection is empty


def generate(structured: StructuredOutput, min_tokens: int = 0, max_tokens: int = 40, **extra: Any) -> list[Any]:
    """[with the draft, without] for the first demo prompt, greedy."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, temperature=0, structured=structured,
                            **extra)
    spec, plain = both(prompts()[:1], [params])
    return [spec[0], plain[0]]


def text(ids: Sequence[int]) -> str:
    return demo()[0].tokenizer.decode([t for t in ids if t != EOS])


# ---- min_tokens and the grammar's end ----
@pytest.mark.parametrize(("structured", "min_tokens", "expected"), [
    (StructuredOutput("json_object"), 30, "{}"),
    (StructuredOutput("json_schema", {"const": 1}), 20, "1"),
], ids=["json_object", "const"])
def test_the_grammars_end_wins_over_min_tokens(structured: StructuredOutput, min_tokens: int, expected: str) -> None:
    for out in generate(structured, min_tokens):
        assert out.finish_reason == "stop", out.error
        assert text(out.token_ids) == expected and out.token_ids[-1] == EOS


def test_min_tokens_holds_while_the_grammar_can_go_on_then_its_end_wins() -> None:
    digits = StructuredOutput("regex", "[0-9]{1,8}")
    eager = {EOS: 100.0}  # EOS whenever it is allowed
    for min_tokens, expected in [(0, 1), (5, 5), (30, 8)]:  # digits before the EOS
        spec, plain = generate(digits, min_tokens, logit_bias=eager)
        assert spec.token_ids == plain.token_ids and spec.finish_reason == "stop"
        assert text(spec.token_ids).isdigit() and len(text(spec.token_ids)) == expected, text(spec.token_ids)


# ---- a grammar that cannot go on ----
@pytest.mark.parametrize(("structured", "limit"), [
    (StructuredOutput("json_schema", LEXER_LIMIT), True),
    (StructuredOutput("lark", DEAD_END), False),
], ids=["lexer-limit", "empty-mask"])
def test_a_grammar_that_allows_no_token_mid_output_fails_its_request_alike_every_time(
    structured: StructuredOutput, limit: bool
) -> None:
    runs = generate(structured) + generate(structured)  # twice: a failed matcher leaves no broken grammar behind
    for out in runs:
        assert out.finish_reason == "error" and out.token_ids, out
        assert "the grammar allows no token after" in out.error and "committed" not in out.error, out.error
        assert ("llguidance hit a limit" in out.error) is limit
        assert out.token_ids == runs[0].token_ids and out.error == runs[0].error
    ok = generate(StructuredOutput("json_schema", {"enum": ["ab", "cd"]}))  # the engines serve on
    assert all(o.finish_reason == "stop" for o in ok)


class DeadEndAfter(TokenMatcher):
    """Allows tokens 1 and 2; after 2 it allows nothing."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(4, dtype=torch.bool)
        if 2 not in self.taken:
            mask[1:3] = True
        return mask

    def accept(self, token: int) -> bool:
        self.taken.append(int(token))
        return True

    def rollback(self, n: int) -> None:
        del self.taken[len(self.taken) - n:]

    def is_terminated(self) -> bool:
        return False


def test_a_proposal_ends_before_a_token_that_leads_nowhere_and_an_empty_row_zero_fails() -> None:
    state = GrammarState(DeadEndAfter())
    assert state.walk([1, 2, 1]) == 1  # row 2 would follow 2: nothing allowed there
    assert [m.tolist() for m in state.masks([1])] == [[False, True, True, False]] * 2
    state.advance([1, 2])
    with pytest.raises(GrammarFailure, match="allows no token after 2 token"):
        state.walk([])


# ---- what llguidance says, and what a schema may hold ----
def test_a_panic_of_llguidance_reads_as_its_meaning_without_a_backtrace() -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}} for i in range(2000)]
    with pytest.raises(ValueError) as err:
        demo()[0].engine.grammar.compile(tool_call_structure(tools, "hermes", None, parallel=True))
    message = str(err.value)
    assert "the grammar is too large" in message and "\n" not in message, message
    assert not any(s in message for s in ("backtrace", "<unknown>", "/tmp/", "python-build", " at /")), message


@pytest.mark.parametrize("schema", [
    {"enum": [math.nan]},
    {"const": math.inf},
    {"type": "number", "maximum": -math.inf},
    {"type": "object", "properties": {"x": {"type": "number", "default": math.nan}}},
], ids=["enum-nan", "const-inf", "maximum-minus-inf", "nested-default"])
def test_schemas_with_non_finite_numbers_do_not_compile(schema: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="is not a JSON number"):
        demo()[0].engine.grammar.compile(StructuredOutput("json_schema", schema))


# ---- a real server ----
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(["--device", "cpu", "--tool-call-parser", "hermes"],
                       tmp_path_factory.mktemp("grammar_failures") / "server.log", env={"DFLASH_SPECULATION": "fixed"})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.terminate()


def chat(server: ServerProcess, stream: bool = False, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(payload),  # NaN written as NaN
                      headers={"Content-Type": "application/json"}, timeout=120)


def events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize(("fmt", "min_tokens"), [
    ({"type": "json_object"}, 30), (schema_format({"const": 1}), 20)], ids=["json_object", "const"])
def test_min_tokens_with_a_complete_structured_output_is_no_500(server: ServerProcess, fmt: dict[str, Any],
                                                                min_tokens: int) -> None:
    body = {"response_format": fmt, "min_tokens": min_tokens, "max_tokens": 40, "temperature": 0}
    r = chat(server, **body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and json.loads(choice["message"]["content"]) in ({}, 1)
    streamed = events(chat(server, stream=True, **body))
    assert not any("error" in e for e in streamed), streamed
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e.get("choices")) == (
        choice["message"]["content"])


def test_non_finite_numbers_in_schemas_and_tools_are_400s(server: ServerProcess) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, math.inf]}}}}}
    for body in ({"response_format": schema_format({"enum": [math.nan]})},
                 {"tools": [tool], "tool_choice": "required"}):
        r = chat(server, max_tokens=8, **body)
        assert r.status_code == 400, r.text
        assert "is not a JSON number" in r.json()["error"]["message"]


def test_too_many_tools_is_a_400_without_a_backtrace(server: ServerProcess) -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}} for i in range(2000)]
    r = chat(server, tools=tools, tool_choice="required", max_tokens=8)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "too large" in message and not any(s in message for s in ("backtrace", "<unknown>", "/tmp/")), message


def test_a_grammar_that_cannot_go_on_is_a_400_or_an_error_event_that_says_so(server: ServerProcess) -> None:
    body = {"response_format": schema_format(LEXER_LIMIT), "max_tokens": 40, "temperature": 0}
    r = chat(server, **body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "the grammar allows no token" in r.json()["error"]["message"]
    streamed = events(chat(server, stream=True, **body))
    assert "the grammar allows no token" in streamed[-1]["error"]["message"], streamed
