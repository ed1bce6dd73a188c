"""What the server's parser settings mean for one chat request: how its output is read (``OutputPlan``) and how
its generation is constrained (``StructuredOutput``).

Tool choice follows vLLM: ``none`` leaves tool calls unparsed; ``auto`` (OpenAI's default when tools are given)
needs ``--enable-auto-tool-choice`` and a ``--tool-call-parser`` (400 otherwise); ``required`` and a named tool
constrain the output to calls in the parser's style (``hermes`` when none is set) and always parse. With a
reasoning parser, the thinking is read from where the prompt leaves it, and a constraint starts after the
reasoning's end marker unless the prompt already closed the reasoning; a required / named tool choice's grammar
covers the thinking itself, with a budget after which it ends the thinking (``ChatSetup.thinking_budget``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from dflash_core.grammar import GrammarBackend, LLGuidanceBackend, StructuredOutput
from server.api_error import APIError
from server.chat_output import OutputPlan
from server.chat_request import ChatCompletionRequest
from server.constraints import compile_structured, structured_output
from server.grammar_compile import DEFAULT_TIMEOUT_S, GrammarChecks
from server.prompts import PromptBuilder
from server.reasoning import THINK_END, THINK_START, PromptThinking, ReasoningStyle, prompt_thinking, reasoning_style
from server.tools import TOOL_CALL_END, TOOL_CALL_START, ToolParser, tool_parser_class

DEFAULT_TOOL_STYLE = "hermes"  # the constrained style of required / named tool choices without a parser
PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens read for a thinking marker
# The most thinking (characters) a required / named tool choice waits for before its grammar ends the thinking:
# a model that never closes its thinking still calls (about 2k tokens of English).
THINKING_BUDGET_CHARS = 8192


class ChatSetup:
    """The server's reasoning and tool-call settings, applied per request."""

    def __init__(
        self,
        tokenizer: Any,
        reasoning_parser: str | None,
        tool_call_parser: str | None,
        enable_auto_tool_choice: bool,
        grammar: GrammarBackend | None = None,
        compile_timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.grammar = grammar  # compiles a request's constraint here (None: the engine compiles, or refuses)
        # llguidance's grammars are tried in helper processes first (`check`): a crash or a slow compile is a 400
        self.checks = GrammarChecks(grammar, compile_timeout) if isinstance(grammar, LLGuidanceBackend) else None
        self.reasoning: ReasoningStyle | None = reasoning_style(reasoning_parser) if reasoning_parser else None
        self.tool_call_parser = tool_call_parser
        self.auto_tools = enable_auto_tool_choice
        self.end_ids: list[int] = []
        if self.reasoning is not None:
            self.end_ids = list(tokenizer(self.reasoning.end_marker, add_special_tokens=False)["input_ids"])

    def thinking(self, prompt: list[int]) -> PromptThinking:
        """Where the prompt leaves the thinking."""
        if self.reasoning is None:
            return PromptThinking.NONE
        tail = self.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return prompt_thinking(tail)

    def prepare(
        self, prompts: PromptBuilder, req: ChatCompletionRequest, budget: Callable[[int], int]
    ) -> tuple[list[int], int, OutputPlan, StructuredOutput | None]:
        """``req``'s prompt ids, its completion budget (``budget`` of the prompt's length: max_tokens, a default or
        the context's room; 400 when nothing fits), output plan and constraint (compiled): the whole preparation of a
        chat request, run in a preparation thread (never on the event loop or the engine's thread)."""
        prompt = prompts.chat(req)
        max_tokens = budget(len(prompt))
        return (prompt, max_tokens, *self.plan(req, prompt, max_tokens))

    async def check(self, req: ChatCompletionRequest, request: Any = None) -> None:
        """Before ``prepare``: ``req``'s constraint tried in a grammar helper process, which a crash, a compile
        over ``--grammar-compile-timeout`` or the client's disconnect (``request``) ends; APIError 400 when it
        cannot be used."""
        if self.checks is not None:
            await self.checks.check(req, self.tool_call_parser or DEFAULT_TOOL_STYLE, request)

    async def close(self) -> None:
        """Stop the grammar helper processes."""
        if self.checks is not None:
            await self.checks.close()

    def plan(
        self, req: ChatCompletionRequest, prompt: list[int], max_tokens: int
    ) -> tuple[OutputPlan, StructuredOutput | None]:
        """How ``req``'s output is read and constrained, the constraint compiled when there is a grammar backend
        (400 for ``auto`` tool choice without a parser, or a constraint that does not compile).

        A required / named tool choice is read by the style's own parser whatever ``--tool-call-parser`` says
        (``forced_tools``: calls only, never content). With a reasoning parser and thinking the prompt left open,
        its grammar covers the thinking too (``thinking_budget``); other constraints start after the end
        marker. Markers the tokenizer holds as one token are that token in the grammar (``marker_ids``)."""
        thinking = self.thinking(prompt)
        style = self.tool_call_parser or DEFAULT_TOOL_STYLE
        parser = self._tool_parser(req, style)
        reasoning_open = self.reasoning is not None and thinking is not PromptThinking.CLOSED
        covers_thinking = req.forced_tool() and reasoning_open  # the tool grammar covers the thinking itself
        start_after = self.end_ids if reasoning_open and not covers_thinking else None
        options: dict[str, Any] = {"marker_ids": self.marker_ids}
        if covers_thinking:
            options["thinking_budget"], options["thinking_open"] = self.thinking_budget(max_tokens, thinking)
        structured = structured_output(req, style, start_after or None, options)
        if structured is not None and self.grammar is not None:
            structured = compile_structured(self.grammar, structured, req)
        plan = OutputPlan(
            self.reasoning, thinking, parser, req.parallel_tool_calls is not False, forced_tools=req.forced_tool()
        )
        return plan, structured

    def _tool_parser(self, req: ChatCompletionRequest, style: str) -> type[ToolParser] | None:
        """The tool-call parser of ``req``'s tool choice (400 for ``auto`` without ``--enable-auto-tool-choice``)."""
        if req.forced_tool():
            return tool_parser_class(style)
        if req.effective_tool_choice() != "auto":
            return None
        if not self.auto_tools:
            raise APIError(
                400,
                'tool_choice "auto" needs the server to run with --enable-auto-tool-choice and '
                '--tool-call-parser; use "none", "required" or a named tool',
                param="tool_choice",
            )
        return tool_parser_class(style)

    @functools.cached_property
    def marker_ids(self) -> dict[str, int]:
        """The tool-call and thinking markers the tokenizer holds as one token that is not special (a special one
        may be dropped from the text, where the parsers look for it), and that token."""
        special = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        out = {}
        for marker in (TOOL_CALL_START, TOOL_CALL_END, THINK_START, THINK_END):
            ids = self.tokenizer(marker, add_special_tokens=False)["input_ids"]
            if len(ids) == 1 and ids[0] not in special:
                out[marker] = int(ids[0])
        return out

    def thinking_budget(self, max_tokens: int, thinking: PromptThinking) -> tuple[int, bool]:
        """(characters, opened) of the thinking a forced tool call allows before its grammar forces the end of
        thinking: at most THINKING_BUDGET_CHARS and half of the request's completion budget (``max_tokens``, a
        default or the context's room: a token holds at least one character of ASCII text, so the call keeps the
        other half); opened: the output starts inside the thinking."""
        assert self.reasoning is not None
        return min(THINKING_BUDGET_CHARS, max_tokens // 2), self.reasoning.starts_in_reasoning(thinking)
