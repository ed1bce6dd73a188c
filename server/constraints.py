"""A chat request's output constraint (``dflash_core.grammar.StructuredOutput``): from ``response_format``
(``json_object``, ``json_schema``) or from a ``required`` / named ``tool_choice`` (calls in the tool-call parser's
style, each call's arguments matching its tool's schema). With a reasoning parser, the constraint starts after the
reasoning's end marker, unless the prompt already closed the reasoning.
"""

from __future__ import annotations

import dataclasses

from dflash_core.grammar import StructuredOutput, tool_call_structure
from server.protocol import APIError, ChatCompletionRequest, NamedToolChoice


def structured_output(
    req: ChatCompletionRequest, tool_style: str, start_after: list[int] | None
) -> StructuredOutput | None:
    """The request's constraint, or None (400 when its tools cannot become a grammar)."""
    structured: StructuredOutput | None = None
    choice = req.effective_tool_choice()
    if req.forced_tool():
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        try:
            structured = tool_call_structure(tools, tool_style, named, req.parallel_tool_calls is not False)  # type: ignore[arg-type]
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
