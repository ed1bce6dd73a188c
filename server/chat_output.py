"""A chat choice's output as the client sees it: reasoning, content and tool calls, whole or as stream deltas.

``OutputPlan`` is decided once per request (which reasoning parser, where the prompt left the thinking, which
tool-call parser); ``ChatOutput`` runs it over one choice's text: the reasoning parser first (``server.reasoning``),
then the tool-call parser over the answer only (``server.tools``). A whole response is the same parse of the whole
text, so streams and whole responses agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.reasoning import PromptThinking, ReasoningSplitter, ReasoningStyle
from server.tools import ToolCall, ToolCallDelta, ToolParser


@dataclass
class ChatDelta:
    """What one piece of output adds."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: ChatDelta) -> ChatDelta:
        return ChatDelta(
            self.reasoning + other.reasoning, self.content + other.content, [*self.tool_calls, *other.tool_calls]
        )


@dataclass(frozen=True)
class OutputPlan:
    """How a request's output is read: the reasoning style (None: no reasoning parser) and the tool-call parser
    (None: tool calls are not parsed; ``forced_tools``: a required / named tool choice, whose answer is calls
    only, never content)."""

    reasoning: ReasoningStyle | None = None
    thinking: PromptThinking = PromptThinking.NONE
    tool_parser: type[ToolParser] | None = None
    parallel_tool_calls: bool = True
    forced_tools: bool = False

    def output(self) -> ChatOutput:
        """A fresh reader for one choice."""
        splitter = self.reasoning.splitter(self.thinking) if self.reasoning is not None else None
        tools = None
        if self.tool_parser is not None:
            tools = self.tool_parser(self.parallel_tool_calls, forced=self.forced_tools)
        return ChatOutput(splitter, tools)


@dataclass
class ChatMessageParts:
    """A whole choice's message."""

    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]


class ChatOutput:
    """One choice's output, piece by piece (``feed`` / ``finish``) or whole (``parse``)."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The complete calls so far."""
        return self._tools.calls if self._tools is not None else []

    def _answer(self, content: str, final: bool) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(content=content)
        t = self._tools.feed(content)
        if final:
            t = t + self._tools.finish()
        return ChatDelta(content=t.content, tool_calls=t.calls)

    def feed(self, text: str) -> ChatDelta:
        """The delta of the next piece of text (markers still incomplete are held)."""
        if self._reasoning is None:
            return self._answer(text, final=False)
        r = self._reasoning.feed(text)
        return ChatDelta(reasoning=r.reasoning) + self._answer(r.content, final=False)

    def finish(self) -> ChatDelta:
        """What is still held at the end of the output."""
        if self._reasoning is None:
            return self._answer("", final=True)
        r = self._reasoning.finish()
        return ChatDelta(reasoning=r.reasoning) + self._answer(r.content, final=True)

    def parse(self, text: str) -> ChatMessageParts:
        """A whole output (a call that does not parse leaves the answer as content)."""
        if self._reasoning is not None:
            r = self._reasoning.split(text)
            reasoning: str | None = r.reasoning
            answer = r.content
        else:
            reasoning, answer = None, text
        if self._tools is None:
            return ChatMessageParts(reasoning, answer, [])
        t = self._tools.parse(answer)
        return ChatMessageParts(reasoning, t.content, list(self._tools.calls))
