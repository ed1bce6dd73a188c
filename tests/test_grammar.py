"""Structured outputs: json_schema, json_object, regex and tool-call grammars give the same output with and without
speculation, the output follows the grammar, and a draft token the grammar rejects ends the proposal there."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from dflash_core.engine import Engine
from dflash_core.generate import iter_steps, run_to_completion
from dflash_core.grammar import GrammarState, LLGuidanceBackend, StructuredOutput
from dflash_core.runners.base import PerRequestDrafter
from dflash_core.sampling import SamplingParams
from dflash_core.tool_grammar import tool_call_structure
from tests.demo_engines import accepted_drafts, both, demo, prompts

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100000},
                                           "unit": {"enum": ["m", "cm", "km"]}, "exact": {"type": "boolean"}},
          "required": ["answer", "unit", "exact"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 1000},
                                         "to": {"enum": ["m", "cm"]}},
        "required": ["value", "to"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "multiply", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
REGEX = r"The answer is [0-9]{1,6} (meters|centimeters)\."


def text_of(ids: list[int]) -> str:
    tok = demo()[0].tokenizer
    return tok.decode(ids[:-1] if ids and ids[-1] in demo()[0].engine.eos_token_ids else ids)


def check_tool_calls(text: str, style: str) -> list[dict[str, Any]]:
    """The calls in `text` (every one well-formed, its arguments valid for its tool)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if style == "hermes":
        bodies = re.fullmatch(r"(<tool_call>\n.*?\n</tool_call>\n?)+", text, re.S) and re.findall(
            r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
        key = "arguments"
    else:
        bodies, key = text.split("; "), "parameters"
    assert bodies, text
    calls = [json.loads(b) for b in bodies]
    for call in calls:
        jsonschema.validate(call[key], schemas[call["name"]])
    return calls


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_grammars_speculative_equals_plain_and_the_output_follows_them(sampled: bool) -> None:
    base = dict(max_tokens=80, temperature=0.9 if sampled else 0.0, seed=5)
    cases = {
        "json_schema": StructuredOutput("json_schema", SCHEMA, strict=True),
        "json_object": StructuredOutput("json_object"),
        "regex": StructuredOutput("regex", REGEX),
        "hermes": tool_call_structure(TOOLS, "hermes", None, parallel=False),
        "llama3_json": tool_call_structure(TOOLS, "llama3_json", None, parallel=False),
    }
    ps = prompts()[:1]
    names = [n for n in cases for _ in ps]
    spec, plain = both([p for _ in cases for p in ps], [SamplingParams(**base, structured=cases[n]) for n in names])
    for name, a, b in zip(names, spec, plain):
        assert a.token_ids == b.token_ids, (name, text_of(a.token_ids), text_of(b.token_ids))
    assert accepted_drafts(spec) > 0  # the demo draft rarely predicts JSON, but speculation ran
    for name, out in zip(names, spec):
        text = text_of(out.token_ids)
        if name == "json_object":  # a weak model may write a string until max_tokens; when it ends, an object
            assert text.startswith("{") and (out.finish_reason == "length" or isinstance(json.loads(text), dict))
            continue
        assert out.finish_reason == "stop", (name, text)  # bounded grammars: the end comes within max_tokens
        if name == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif name == "regex":
            assert re.fullmatch(REGEX, text), text
        elif name == "hermes":
            assert len(check_tool_calls(text, "hermes")) == 1
        else:
            assert len(check_tool_calls(text, "llama3_json")) == 1


@pytest.mark.parametrize("style", ["hermes", "llama3_json"])
def test_parallel_tool_calls_allow_several_calls_and_single_ones_one(style: str) -> None:
    tok, backend = demo()[0].tokenizer, small_backend()
    one = {"hermes": '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
           "llama3_json": '{"name": "multiply", "parameters": {"a": 3, "b": 4}}'}[style]
    two = one.replace("multiply", "convert").replace('"a": 3, "b": 4', '"value": 5, "to": "cm"')
    text = one + {"hermes": "\n", "llama3_json": "; "}[style] + two
    assert [c["name"] for c in check_tool_calls(text, style)] == ["multiply", "convert"]
    for parallel, accepted in [(True, True), (False, False)]:
        matcher = backend.matcher(tool_call_structure(TOOLS, style, None, parallel), [2])
        assert all(matcher.accept(t) for t in tok.encode(one, add_special_tokens=False))
        rest = tok.encode(text[len(one):], add_special_tokens=False)
        assert all(matcher.accept(t) for t in rest) is accepted
        assert matcher.accept(2) and matcher.is_terminated()
    bad = tok.encode(one.replace('"a": 3', '"a": "3"'), add_special_tokens=False)  # arguments off the schema
    matcher = backend.matcher(tool_call_structure(TOOLS, style, None, True), [2])
    assert not all(matcher.accept(t) for t in bad)


class RejectedTokenDrafter(PerRequestDrafter):
    """Proposes the reference output, with the token at index k (cycling through `cuts`) replaced by one the
    grammar never allows; records the proposal length the engine should keep."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], bad: int, stop_ids: set[int],
                 cuts: tuple[int, ...] = (4, 0, 9, 2, 15)) -> None:
        self.block_size = 16
        self.references, self.bad, self.stop_ids, self.cuts = references, bad, stop_ids, cuts
        self.expected: list[int] = []

    def new_state(
        self, slot: int, prompt_token_ids: list[int], blocks: list[int] | None = None, cached: int = 0
    ) -> dict[str, Any]:
        return {"seq": list(prompt_token_ids) + self.references[tuple(prompt_token_ids)], "calls": 0}

    def extend_context(self, state: dict[str, Any], features: Any) -> None:
        pass

    def propose(self, state: dict[str, Any], last_token: int, position: int, n: int) -> list[int]:
        k = self.cuts[state["calls"] % len(self.cuts)]
        state["calls"] += 1
        seq = state["seq"]
        truth = [seq[position + j] if position + j < len(seq) else self.bad for j in range(1, n + 1)]
        proposal = [self.bad if j == k else t for j, t in enumerate(truth)]
        keep = min(k, n)
        ends = [j for j, t in enumerate(proposal[:keep]) if t in self.stop_ids]
        self.expected.append(ends[0] + 1 if ends else keep)  # nothing is proposed past a stop token
        return proposal


def test_a_draft_token_the_grammar_rejects_ends_the_proposal() -> None:
    models, plain = demo()
    target, eos = models.engine.target, models.engine.eos_token_ids
    brace = models.tokenizer.encode("{", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=40, structured=StructuredOutput("regex", REGEX))
    ps = prompts()
    refs = {tuple(p): list(o.token_ids) for p, o in zip(ps, both(ps, [params] * len(ps))[1])}
    drafter = RejectedTokenDrafter(refs, brace, set(eos))
    engine = Engine(target, drafter, eos_token_ids=eos, kv=models.engine.kv, grammar=models.engine.grammar,
                    speculation="fixed")
    drafted: list[int] = []
    outs = {}
    for req, step in iter_steps(engine, ps, params):
        if not step.is_prefill and step.finish_reason != "abort":
            drafted.append(step.num_draft_tokens)
        outs[req.index] = req
    assert [outs[i].token_ids for i in range(len(ps))] == [refs[tuple(p)] for p in ps]
    assert sorted(drafted) == sorted(drafter.expected)  # every proposal cut at its rejected token
    assert sum(drafted) > 0 and 0 in drafted


def small_backend() -> LLGuidanceBackend:
    return demo()[0].engine.grammar


def test_masks_of_the_rows_equal_a_fresh_matcher_token_by_token_and_the_marker_defers_the_grammar() -> None:
    tok = demo()[0].tokenizer
    backend = small_backend()
    regex = StructuredOutput("regex", REGEX)
    ids = tok.encode("The answer is 42 meters.", add_special_tokens=False)
    state = GrammarState(backend.matcher(regex, [2]))
    state.advance(ids[:2])
    draft = ids[2:]
    assert state.walk(draft) == len(draft)
    masks = state.masks(draft)
    for i in range(len(draft) + 1):
        fresh = backend.matcher(regex, [2])
        assert all(fresh.accept(t) for t in ids[: 2 + i])
        assert masks[i] is not None and bool((masks[i] == fresh.allowed()).all()), i
    brace = tok.encode("{", add_special_tokens=False)[0]
    assert state.walk(draft[:3] + [brace] + draft[3:]) == 3

    marker = tok.encode("\n\n", add_special_tokens=False)
    marker = marker if len(marker) == 2 else tok.encode("\n", add_special_tokens=False) * 2
    deferred = GrammarState(backend.matcher(regex, [2]), start_after=marker)
    free = tok.encode("hmm {", add_special_tokens=False)
    assert deferred.advance(free + marker[:1]) is None and not deferred.started
    # row 0 follows the first half of the marker (free), the marker ends in the draft, then the grammar applies
    assert deferred.walk([marker[1], brace]) == 1
    assert deferred.walk([marker[1], ids[0], brace]) == 2
    assert [m is None for m in deferred.masks([marker[1], ids[0]])] == [True, False, False]
    deferred.advance([marker[1], *ids])
    assert deferred.started and not deferred.is_terminated()
    assert deferred.advance([2]) == 1 and deferred.is_terminated()


def test_start_after_leaves_the_text_before_the_marker_free() -> None:
    """The grammar starts after the marker (here the output's first line break, standing in for `</think>`)."""
    tok = demo()[0].tokenizer
    ps = prompts()[:1]
    free = run_to_completion(demo()[1], ps, SamplingParams(max_tokens=48))[0].token_ids
    at = next(i for i, t in enumerate(free) if "\n" in tok.decode([t]))
    marker = free[at:at + 1]
    deferred = SamplingParams(max_tokens=48, structured=StructuredOutput("regex", REGEX, start_after=marker))
    spec, plain = both(ps, [deferred])
    assert spec[0].token_ids == plain[0].token_ids
    assert spec[0].token_ids[: at + 1] == free[: at + 1]
    assert re.fullmatch(REGEX, text_of(spec[0].token_ids[at + 1:])), text_of(spec[0].token_ids)


def test_the_grammar_end_ends_the_request_even_with_ignore_eos() -> None:
    eos = demo()[0].engine.eos_token_ids
    params = SamplingParams(max_tokens=40, ignore_eos=True, structured=StructuredOutput("json_schema", SCHEMA))
    spec, plain = both(prompts()[:1], [params])
    assert spec[0].token_ids == plain[0].token_ids
    assert spec[0].finish_reason == "stop" and spec[0].token_ids[-1] in eos


def test_ids_beyond_the_tokenizer_are_never_allowed() -> None:
    tok = demo()[0].tokenizer
    backend = LLGuidanceBackend(tok, len(tok) + 64)
    allowed = backend.matcher(StructuredOutput("json_object"), [2]).allowed()
    assert allowed.shape == (len(tok) + 64,) and allowed[: len(tok)].any() and not allowed[len(tok):].any()


def test_refusals_name_the_problem() -> None:
    models, _ = demo()
    with pytest.raises(ValueError, match="grammar backend"):
        Engine(models.engine.target, None, kv=models.engine.kv).add_request(
            [1, 2], SamplingParams(structured=StructuredOutput("json_object")))
    with pytest.raises(ValueError, match="does not compile"):
        models.engine.add_request([1, 2], SamplingParams(structured=StructuredOutput("regex", "(unclosed")))
    for bad, field in [(StructuredOutput("yaml"), "kind"), (StructuredOutput("json_schema", "x"), "spec"),
                       (StructuredOutput("json_object", start_after=[]), "start_after")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(structured=bad).validate()
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_structure(TOOLS, "hermes", named="nope", parallel=False)
    with pytest.raises(ValueError, match="style"):
        tool_call_structure(TOOLS, "xml", None, parallel=False)  # type: ignore[arg-type]


def test_a_named_tool_choice_calls_that_tool() -> None:
    named = tool_call_structure(TOOLS, "hermes", named="multiply", parallel=False)
    spec, plain = both(prompts()[1:2], [SamplingParams(max_tokens=80, structured=named)])
    assert spec[0].token_ids == plain[0].token_ids
    calls = check_tool_calls(text_of(spec[0].token_ids), "hermes")
    assert [c["name"] for c in calls] == ["multiply"]


def accepts(matcher: Any, text: str) -> bool:
    return all(matcher.accept(t) for t in demo()[0].tokenizer.encode(text, add_special_tokens=False))


def test_json_is_compact_and_a_stop_id_ends_the_grammar_only_where_it_accepts() -> None:
    backend, eos, stop = small_backend(), 2, 3  # the request's stop id here is not the tokenizer's EOS
    for text, ok in [('{"a": 1, "b": [1, 2]}', True), ('{"a":1}', False), ('{ "a": 1}', False), ('[1]', False)]:
        assert accepts(backend.matcher(StructuredOutput("json_object"), [stop]), text) is ok, text
    matcher = backend.matcher(StructuredOutput("json_object"), [stop])
    assert not matcher.allowed()[stop] and not matcher.accept(stop)
    assert accepts(matcher, '{"a": 1')
    assert not matcher.allowed()[stop] and not matcher.accept(stop)
    assert accepts(matcher, "}")
    allowed = matcher.allowed()
    assert allowed[stop] and not allowed[eos] and not matcher.accept(eos)  # EOS is no end of this request
    assert matcher.accept(stop) and matcher.is_terminated() and not matcher.allowed().any()
    matcher.rollback(2)  # the stop id and "}"
    assert not matcher.is_terminated() and not matcher.allowed()[stop] and accepts(matcher, ', "b": 2}')
    assert matcher.accept(stop) and matcher.is_terminated()


def test_gbnf_lark_and_tool_definitions_compile() -> None:
    backend = small_backend()
    gbnf = StructuredOutput("ebnf", 'root ::= "The answer is " [0-9]+ unit\nunit ::= " meters." | " cm."')
    lark = StructuredOutput("lark", 'start: "The answer is " /[0-9]+/ UNIT\nUNIT: " meters." | " cm."')
    for structured in (gbnf, lark):
        assert accepts(backend.matcher(structured, [2]), "The answer is 42 cm.")
        assert not accepts(backend.matcher(structured, [2]), "The answer is 42 km.")
    point = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
             "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    tools = [{"type": "function", "function": {"name": "plot", "parameters": point}}]
    matcher = backend.matcher(tool_call_structure(tools, "llama3_json", None, parallel=False), [2])
    assert accepts(matcher, '{"name": "plot", "parameters": {"p": {"x": 3}}}') and matcher.accept(2)
    assert not accepts(backend.matcher(tool_call_structure(tools, "llama3_json", None, parallel=False), [2]),
                       '{"name": "plot", "parameters": {"p": {"y": 3}}}')
    odd = [{"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "if": {}}}}]
    with pytest.raises(ValueError, match="tool 'odd'"):
        tool_call_structure(odd, "hermes", None, parallel=False)


def test_root_relative_refs_of_tool_parameters_keep_their_meaning() -> None:
    """"#" and "#/properties/..." in a tool's parameters point at the parameters, not at the call around them."""
    backend = small_backend()
    tree = {"type": "object", "required": ["v"], "additionalProperties": False,
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}},
                           "same": {"$ref": "#/properties/v"}}}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}}]
    for style, key in (("llama3_json", "parameters"), ("hermes", "arguments")):
        wrap = ("", "") if style == "llama3_json" else ("<tool_call>\n", "\n</tool_call>")

        def call(args: str) -> str:
            return f'{wrap[0]}{{"name": "tree", "{key}": {args}}}{wrap[1]}'  # noqa: B023 - used at once

        def matcher() -> Any:
            return backend.matcher(tool_call_structure(tools, style, None, parallel=False), [2])  # noqa: B023

        good = matcher()
        assert accepts(good, call('{"v": 1, "kids": [{"v": 2, "kids": []}], "same": 3}')) and good.accept(2), style
        assert not accepts(matcher(), call('{"v": 1, "kids": [{"name": "tree", "' + key + '": {"v": 2}}]}')), style
        assert not accepts(matcher(), call('{"v": 1, "same": "x"}')), style
    nested_id = {"type": "object", "properties": {"p": {"$id": "https://x/p", "type": "object"}}}
    with pytest.raises(ValueError, match="nested \\$id"):
        tool_call_structure([{"type": "function", "function": {"name": "n", "parameters": nested_id}}], "hermes",
                            None, parallel=False)


def test_the_tokenizer_is_read_on_the_first_structured_request() -> None:
    backend = LLGuidanceBackend(object(), 100)  # no tokenizer at all: only a structured request finds out
    with pytest.raises(ValueError, match="unavailable for this tokenizer"):
        backend.matcher(StructuredOutput("json_object"), [2])
