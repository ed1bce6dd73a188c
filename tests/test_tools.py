"""Tool-call parsers on scripted model text: whole outputs, and streams cut at every piece boundary (a call split
across deltas) whose deltas join into the whole output's calls, in OpenAI's delta shape."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from server.tools import HermesParser, Llama3JsonParser, ToolParser, tool_parser_class

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } b \\" c"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": {"tz": "CET"}}}\n</tool_call>'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'


def stream(parser: ToolParser, text: str, step: int) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """(content, calls joined from the deltas, the deltas in OpenAI's shape) of ``text`` fed ``step`` characters
    at a time."""
    content, deltas = "", []
    for i in range(0, len(text), step):
        out = parser.feed(text[i : i + step])
        content += out.content
        deltas.extend(d.to_dict() for d in out.calls)
    out = parser.finish()
    content += out.content
    deltas.extend(d.to_dict() for d in out.calls)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls, "one first delta per call"
            assert d["type"] == "function" and d["function"]["arguments"] == ""
            calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, list(calls.values()), deltas


def test_hermes_whole_output() -> None:
    parser = HermesParser()
    out = parser.parse(HERMES)
    assert out.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Paris", "note": 'a } b " c'}),
        ("get_time", {"zone": {"tz": "CET"}}),
    ]
    assert all(c.id.startswith("call_") for c in parser.calls) and parser.calls[0].id != parser.calls[1].id


@pytest.mark.parametrize("step", [1, 2, 3, 4, 7, 13, 1000])
def test_hermes_stream_deltas_join_into_the_whole_calls(step: int) -> None:
    whole = HermesParser()
    whole.parse(HERMES)
    content, calls, deltas = stream(HermesParser(), HERMES, step)
    assert content == "Let me check.\n"
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    if step < 10:
        assert sum("id" not in d for d in deltas) > 2, "arguments arrive in fragments as they are written"


def test_hermes_call_split_across_deltas_shows_the_name_first() -> None:
    parser = HermesParser()
    assert parser.feed("Hi <tool_").content == "Hi "  # "<tool_" is held: it may start a call
    first = parser.feed('call>\n{"name": "get_wea')
    assert first.content == "" and first.calls == []
    named = parser.feed('ther", "arguments": {"ci')
    assert [d.to_dict()["function"] for d in named.calls] == [
        {"name": "get_weather", "arguments": ""},
        {"arguments": '{"ci'},
    ]
    rest = parser.feed('ty": "Oslo"}}\n</tool_call>')
    assert "".join(d.arguments for d in rest.calls) == 'ty": "Oslo"}'
    assert parser.finish().calls == [] and parser.calls[0].arguments == '{"city": "Oslo"}'


def test_hermes_invalid_call_is_content_in_a_whole_response() -> None:
    text = 'ok <tool_call>{"name": nope}</tool_call>'
    parser = HermesParser()
    assert parser.parse(text).content == text and parser.calls == []


def test_hermes_unclosed_call_at_the_end_is_parsed() -> None:
    parser = HermesParser()
    parser.parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}')
    assert [(c.name, c.arguments) for c in parser.calls] == [("f", '{"x": 1}')]


def test_hermes_arguments_as_a_json_string_are_unwrapped() -> None:
    parser = HermesParser()
    parser.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert parser.calls[0].arguments == '{"x": 1}'


def test_parallel_false_keeps_the_first_call() -> None:
    parser = HermesParser(parallel=False)
    parser.parse(HERMES)
    assert [c.name for c in parser.calls] == ["get_weather"]
    _, calls, _ = stream(HermesParser(parallel=False), HERMES, 3)
    assert [c["name"] for c in calls] == ["get_weather"]


def test_llama3_json_whole_and_streamed() -> None:
    parser = Llama3JsonParser()
    out = parser.parse(LLAMA)
    assert out.content == ""
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    for step in (1, 2, 5):
        content, calls, _ = stream(Llama3JsonParser(), LLAMA, step)
        assert content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in parser.calls]


def test_llama3_json_plain_text_is_content() -> None:
    text = "The weather is {unknown} today."
    assert Llama3JsonParser().parse(text).content == text
    content, calls, _ = stream(Llama3JsonParser(), text, 2)
    assert content == text and calls == []


def test_parser_names() -> None:
    assert tool_parser_class("hermes") is HermesParser
    assert tool_parser_class("llama3_json") is Llama3JsonParser
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        tool_parser_class("mistral")


@pytest.mark.parametrize("parser_class", [HermesParser, Llama3JsonParser])
def test_a_long_call_streams_in_linear_time(parser_class: type[ToolParser]) -> None:
    """A 48k-character argument in 16-character steps: each step scans only what it adds (a scan of the whole call
    text per step, ~3000 scans of up to 48k characters, takes far longer than the bound)."""
    value = "x\\\"{[" * 8000  # escapes, quotes and brackets inside the string: the scanner's slow paths
    key = "arguments" if parser_class is HermesParser else "parameters"
    body = f'{{"name": "f", "{key}": {{"text": "{value}", "n": [1, {{"a": 2}}]}}}}'
    text = f"<tool_call>\n{body}\n</tool_call>" if parser_class is HermesParser else body
    start = time.perf_counter()
    content, calls, deltas = stream(parser_class(), text, 16)
    elapsed = time.perf_counter() - start
    assert content == "" and [c["name"] for c in calls] == ["f"]
    assert json.loads(calls[0]["arguments"]) == {"text": 'x"{[' * 8000, "n": [1, {"a": 2}]}
    assert len(deltas) > 1000  # the arguments did stream
    assert elapsed < 2.0, f"{elapsed:.2f} s"


# --- forced parsers: required / named tool_choice, whose grammar allows calls only ---------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>'


@pytest.mark.parametrize("cut", [len(CALL) - 5, len('<tool_call>\n{"name": "get_weather", "arguments": {"ci')])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_forced_output_cut_by_max_tokens_is_calls_as_streamed(cut: int, step: int) -> None:
    """Cut inside the end marker, the call is complete; cut inside its arguments, it is kept as streamed (name and
    the arguments written): the whole output's calls are the stream's, and no markup is ever content."""
    text = CALL + "\n" + CALL[:cut]
    whole = HermesParser(forced=True)
    out = whole.parse(text)
    content, calls, _ = stream(HermesParser(forced=True), text, step)
    assert out.content == content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
    complete, last = whole.calls
    assert json.loads(complete.arguments) == {"city": "Paris", "days": 1}
    if cut > len(CALL) - 13:  # only the end marker is cut
        assert json.loads(last.arguments) == {"city": "Paris", "days": 1}
    else:
        assert last.name == "get_weather" and last.arguments == '{"ci'


def test_forced_output_without_a_name_yet_has_no_call() -> None:
    parser = HermesParser(forced=True)
    out = parser.parse(CALL + '\n<tool_call>\n{"na')
    assert out.content == "" and [c.name for c in parser.calls] == ["get_weather"]


@pytest.mark.parametrize("parser_class", [HermesParser, Llama3JsonParser])
def test_forced_parser_never_returns_content(parser_class: type[ToolParser]) -> None:
    text = "\n\n" + (CALL if parser_class is HermesParser else '{"name": "f", "parameters": {"x": 1}}')
    parser = parser_class(forced=True)
    assert parser.parse(text).content == "" and [c.name for c in parser.calls] in (["get_weather"], ["f"])
    assert stream(parser_class(forced=True), "free text <tool_call", 2)[0] == ""


def test_llama3_json_forced_cut_keeps_the_call_as_streamed() -> None:
    text = '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": [1, 2'
    parser = Llama3JsonParser(forced=True)
    parser.parse(text)
    assert [(c.name, c.arguments) for c in parser.calls] == [("f", '{"x": 1}'), ("g", '{"y": [1, 2')]
    _, calls, _ = stream(Llama3JsonParser(forced=True), text, 4)
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in parser.calls]


def test_a_complete_call_cut_inside_its_end_marker_is_a_call_with_auto_too() -> None:
    parser = HermesParser()
    out = parser.parse("Sure.\n" + CALL[:-4])
    assert out.content == "Sure.\n" and [(c.name, c.arguments) for c in parser.calls] == [
        ("get_weather", '{"city": "Paris", "days": 1}')
    ]


def test_auto_keeps_an_unparsed_cut_call_as_content() -> None:
    text = "Sure.\n" + CALL[:40]
    parser = HermesParser()
    assert parser.parse(text).content == text and parser.calls == []
