"""Tool calls as a grammar: `tool_call_structure` expresses "one or more calls of these tools, each with
arguments matching its schema" (with an optional bounded thinking block before them) in the two text styles the
tool-call parsers read (hermes, llama3_json), as a Lark `StructuredOutput`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from dflash_core.grammar import JSON_OPTIONS, StructuredOutput, llguidance_errors

TOOL_STYLES = ("hermes", "llama3_json")
# How each style writes one call, and what separates parallel calls (what the matching tool-call parser reads).
_TOOL_TAGS = {
    "hermes": ("<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
    "llama3_json": ("", "", "; ", "parameters"),
}

# At most this many calls in one answer with parallel_tool_calls: a model that repeats its call (small models
# do) stops after a few instead of filling max_tokens, and a real answer rarely needs more.
MAX_PARALLEL_TOOL_CALLS = 8
THINK_START, THINK_END = "<think>", "</think>"


def tool_call_structure(
    tools: Sequence[dict[str, Any]],
    style: Literal["hermes", "llama3_json"],
    named: str | None = None,
    parallel: bool = True,
    thinking_budget: int | None = None,
    thinking_open: bool = True,
    marker_ids: dict[str, int] | None = None,
) -> StructuredOutput:
    """A Lark `StructuredOutput` for tool calls: one call (with `parallel` and no `named` tool, one to
    MAX_PARALLEL_TOOL_CALLS) of `tools` (OpenAI `{"type": "function", "function": {...}}` entries), or of the tool
    `named` only, each call's arguments matching that tool's `parameters` JSON schema; ValueError naming a tool
    whose parameters do not compile.

    hermes writes `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, parallel calls joined by "\\n";
    llama3_json writes `{"name": N, "parameters": {...}}`, parallel calls joined by "; ".

    `thinking_budget` (characters; None: the output is the calls alone): the calls follow a reasoning block that
    ends at its first `</think>` or is ended there after that many characters (a thinking budget, so that a
    model that never closes its thinking still calls). `thinking_open`: the output starts inside the block (the
    prompt opened it); otherwise the block, `<think>` first, is optional.

    `marker_ids`: the markers (`<tool_call>`, `</think>`, ...) that the tokenizer holds as one token, and that
    token: the grammar writes them as that token (llguidance takes every added token for a special token, which
    the marker's text never matches, so the model would have to spell the marker out).
    """
    from llguidance import LLMatcher

    if style not in _TOOL_TAGS:
        raise ValueError(f"tool-call style must be one of {', '.join(TOOL_STYLES)}, got {style!r}")
    begin, end, separator, args_key = _TOOL_TAGS[style]
    functions = [tool.get("function", tool) for tool in tools]
    if named is not None:
        functions = [f for f in functions if f.get("name") == named]
        if not functions:
            raise ValueError(f"tool_choice names {named!r}, which is not among the tools")
    if not functions:
        raise ValueError("tools must hold at least one function")
    rules = []
    for i, fn in enumerate(functions):
        # OpenAI: omitted parameters define a function with an empty parameter list, so its arguments are {}
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False})
        # each call is its own schema document: the parameters' definitions move to its root, where their
        # "#/$defs/..." references point; every other root-relative reference ("#", "#/properties/...") is
        # rebased onto where the parameters now sit
        params.pop("$id", None)  # the parameters are no longer a document of their own
        params = _rebase_refs(params, f"#/properties/{args_key}", fn["name"])
        defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
        schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                  "required": ["name", args_key], "additionalProperties": False, **defs, "x-guidance": JSON_OPTIONS}
        with llguidance_errors(f"tool {fn['name']!r}: parameters do not compile"):
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
        if error:
            raise ValueError(f"tool {fn['name']!r}: parameters do not compile: {error}")
        rules.append(f"call_{i}: %json {json.dumps(schema)}")
    # the calls' JSON share one lexeme class, so the parser keeps every tool open until "name" decides
    ids = marker_ids or {}
    call = " ".join(p for p in (_lark_text(begin, ids), "body", _lark_text(end, ids)) if p)
    more = MAX_PARALLEL_TOOL_CALLS - 1 if parallel and named is None else 0
    calls = f"call ({_lark_text(separator, ids)} call){{0,{more}}}" if more else "call"
    body = "body: " + " | ".join(f"call_{i}" for i in range(len(functions)))
    lines = [*_thinking_rules(thinking_budget, thinking_open, calls, ids), f"call: {call}", body, *rules]
    return StructuredOutput("lark", "\n".join(lines) + "\n")


def _lark_text(text: str, marker_ids: dict[str, int]) -> str:
    """`text` as a Lark sequence: the markers in `marker_ids` as their token, the rest as literals."""
    for marker, token in marker_ids.items():
        i = text.find(marker)
        if i >= 0:
            parts = (_lark_text(text[:i], marker_ids), f"<[{token}]>", _lark_text(text[i + len(marker):], marker_ids))
            return " ".join(p for p in parts if p)
    return json.dumps(text) if text else ""


def _thinking_rules(budget: int | None, opened: bool, calls: str, marker_ids: dict[str, int]) -> list[str]:
    """The start rule of `tool_call_structure`: `calls`, after a reasoning block of at most `budget` characters
    when there is one. The block's text is one lexeme bounded so that once the budget is spent only `</think>`
    can follow (a grammar-level max_tokens would end rollback, which speculative decoding needs): lazy, up to its
    first `</think>`, or, when `</think>` is one token, any text without it, then that token."""
    if budget is None:
        return [f"start: {calls}"]
    end = THINK_END.replace("/", "\\/")
    if THINK_END in marker_ids:
        text = f"THINK_TEXT: /(?s:.){{1,{max(budget, 1)}}}/ & ~/(?s:.*){end}(?s:.*)/"
        block_body = f"THINK_TEXT? <[{marker_ids[THINK_END]}]>"
    else:
        text, block_body = f"think_text[lazy]: /(?s:.){{0,{budget}}}{end}/", "think_text"
    block = "think_block" if opened else f"({_lark_text(THINK_START, marker_ids)} think_block)?"
    # Qwen writes "</think>\\n\\n" before its answer
    return [f"start: {block} {calls}", f'think_block: {block_body} ("\\n" | "\\n\\n")?', text]


_DEF_KEYS = ("$defs", "definitions")
# JSON-schema keywords whose values are data, not schemas (the server keeps their keys as client text too)
SCHEMA_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples", "dependentRequired"})


def _rebase_refs(schema: Any, base: str, tool: str) -> Any:
    """`schema` with its root-relative `$ref`s pointing under `base` (a JSON pointer fragment), except those into
    its own `$defs` / `definitions`, which move to the new root with it; ValueError for a nested `$id` (the
    references under it are relative to another document, which the rewrite cannot follow)."""

    def rebase(ref: str) -> str:
        if ref != "#" and not ref.startswith("#/"):
            return ref  # a remote reference or an anchor: not root-relative
        path = ref[1:]
        if any(path == f"/{k}" or path.startswith(f"/{k}/") for k in _DEF_KEYS):
            return ref
        return base + path

    def walk(value: Any, root: bool) -> Any:
        if isinstance(value, list):
            return [walk(v, False) for v in value]
        if not isinstance(value, dict):
            return value
        if not root and isinstance(value.get("$id"), str):
            raise ValueError(f"tool {tool!r}: parameters with a nested $id are not supported")
        out: dict[str, Any] = {}
        for k, v in value.items():
            if k == "$ref" and isinstance(v, str):
                out[k] = rebase(v)
            elif k == "properties" and isinstance(v, dict):  # property names are names, their values schemas
                out[k] = {name: walk(sub, False) for name, sub in v.items()}
            elif k in SCHEMA_DATA_KEYWORDS:
                out[k] = v
            else:
                out[k] = walk(v, False)
        return out

    return walk(schema, True)
