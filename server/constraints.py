"""A chat request's output constraint (``dflash_core.grammar.StructuredOutput``): from ``response_format``
(``json_object``, ``json_schema``) or from a ``required`` / named ``tool_choice`` (calls in the tool-call parser's
style, each call's arguments matching its tool's schema). With a reasoning parser, the constraint starts after the
reasoning's end marker, unless the prompt already closed the reasoning.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dflash_core.grammar import GrammarBackend, StructuredOutput
from dflash_core.grammar_checks import check_schema
from dflash_core.tool_grammar import tool_call_structure
from server.api_error import APIError
from server.chat_request import ChatCompletionRequest, NamedToolChoice

# tools + response_format schema, as JSON: a grammar compiles in time and memory that grow with it
MAX_SCHEMA_BYTES = 256 * 1024


def _param(req: ChatCompletionRequest) -> str:
    """The field a request's constraint comes from."""
    return "tools" if req.forced_tool() else "response_format"


def check_schema_size(req: ChatCompletionRequest) -> None:
    """400 when the request's tools and response_format schema together exceed MAX_SCHEMA_BYTES of JSON."""
    size = sum(len(json.dumps(t.model_dump(exclude_none=True))) for t in req.tools or [])
    if req.response_format is not None and req.response_format.json_schema is not None:
        size += len(json.dumps(req.response_format.json_schema.schema_))
    if size > MAX_SCHEMA_BYTES:
        raise APIError(
            400,
            f"tools and response_format schema hold {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted",
            param="tools" if req.tools else "response_format",
        )


def compile_structured(
    backend: GrammarBackend, structured: StructuredOutput, req: ChatCompletionRequest
) -> StructuredOutput:
    """``structured`` compiled ahead for the engine (400 naming the field when it does not compile)."""
    try:
        return backend.precompile(structured, copies=req.n)  # one matcher per choice, copied here
    except ValueError as e:
        raise APIError(400, f"{_param(req)}: {e}", param=_param(req)) from None


def check_schemas(req: ChatCompletionRequest) -> None:
    """400 for a tool's parameters or the response_format schema that llguidance cannot take safely
    (``dflash_core.grammar_checks.check_schema``: integer bounds beyond int64, schemas with no finite value)."""
    choice = req.effective_tool_choice()
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    forced = [t for t in req.tools or [] if named in (None, t.function.name)] if req.forced_tool() else []
    for tool in forced:
        try:
            check_schema(tool.function.parameters)
        except ValueError as e:
            raise APIError(400, f"tools: tool {tool.function.name!r}: parameters: {e}", param="tools") from None
    fmt = req.response_format
    if not req.forced_tool() and fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
        try:
            check_schema(fmt.json_schema.schema_)
        except ValueError as e:
            raise APIError(400, f"response_format: {e}", param="response_format") from None


def structured_output(
    req: ChatCompletionRequest,
    tool_style: str,
    start_after: list[int] | None,
    tool_options: dict[str, Any] | None = None,
) -> StructuredOutput | None:
    """The request's constraint, or None (400 when its tools cannot become a grammar, or are too big).
    ``tool_options``: more keyword arguments of a forced tool call's ``tool_call_structure`` (its thinking budget,
    the tokenizer's marker tokens)."""
    check_schema_size(req)
    check_schemas(req)
    structured: StructuredOutput | None = None
    choice = req.effective_tool_choice()
    if req.forced_tool():
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        try:
            parallel = req.parallel_tool_calls is not False
            structured = tool_call_structure(tools, tool_style, named, parallel, **(tool_options or {}))  # type: ignore[arg-type]
        except ValueError as e:
            raise APIError(400, f"tools: {e}", param="tools") from None
    elif req.response_format is not None and req.response_format.type == "json_object":
        structured = StructuredOutput("json_object")
    elif req.response_format is not None and req.response_format.type == "json_schema":
        fmt = req.response_format.json_schema
        assert fmt is not None  # the request model checks it
        schema = fmt.schema_ if fmt.schema_ is not None else {"type": "object"}
        structured = StructuredOutput("json_schema", schema, strict=bool(fmt.strict))
    if structured is None or not start_after:
        return structured
    return dataclasses.replace(structured, start_after=list(start_after))
