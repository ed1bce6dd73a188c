"""What the server's parser settings mean for one chat request: how its output is read (``OutputPlan``) and how
its generation is constrained (``StructuredOutput``).

Tool choice follows vLLM: ``none`` leaves tool calls unparsed; ``auto`` (OpenAI's default when tools are given)
needs ``--enable-auto-tool-choice`` and a ``--tool-call-parser`` (400 otherwise); ``required`` and a named tool
constrain the output to calls in the parser's style (``hermes`` when none is set) and always parse. With a
reasoning parser, the thinking is read from where the prompt leaves it, and a constraint starts after the
reasoning's end marker unless the prompt already closed the reasoning.
"""

from __future__ import annotations

from typing import Any

from dflash_core.grammar import GrammarBackend, StructuredOutput
from server.chat_output import OutputPlan
from server.constraints import compile_structured, structured_output
from server.prompts import PromptBuilder
from server.protocol import APIError, ChatCompletionRequest
from server.reasoning import PromptThinking, ReasoningStyle, prompt_thinking, reasoning_style
from server.tools import tool_parser_class

DEFAULT_TOOL_STYLE = "hermes"  # the constrained style of required / named tool choices without a parser
PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens read for a thinking marker


class ChatSetup:
    """The server's reasoning and tool-call settings, applied per request."""

    def __init__(
        self,
        tokenizer: Any,
        reasoning_parser: str | None,
        tool_call_parser: str | None,
        enable_auto_tool_choice: bool,
        grammar: GrammarBackend | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.grammar = grammar  # compiles a request's constraint here (None: the engine compiles, or refuses)
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
        self, prompts: PromptBuilder, req: ChatCompletionRequest
    ) -> tuple[list[int], OutputPlan, StructuredOutput | None]:
        """``req``'s prompt ids, output plan and constraint (compiled): the whole preparation of a chat request, run
        in a preparation thread (never on the event loop or the engine's thread)."""
        prompt = prompts.chat(req)
        return (prompt, *self.plan(req, prompt))

    def plan(self, req: ChatCompletionRequest, prompt: list[int]) -> tuple[OutputPlan, StructuredOutput | None]:
        """How ``req``'s output is read and constrained, the constraint compiled when there is a grammar backend
        (400 for ``auto`` tool choice without a parser, or a constraint that does not compile)."""
        thinking = self.thinking(prompt)
        choice = req.effective_tool_choice()
        style = self.tool_call_parser or DEFAULT_TOOL_STYLE
        parser = None
        if req.forced_tool():
            parser = tool_parser_class(style)
        elif choice == "auto":
            if not self.auto_tools:
                raise APIError(
                    400,
                    'tool_choice "auto" needs the server to run with --enable-auto-tool-choice and '
                    '--tool-call-parser; use "none", "required" or a named tool',
                    param="tool_choice",
                )
            parser = tool_parser_class(style)
        start_after = self.end_ids if self.reasoning is not None and thinking is not PromptThinking.CLOSED else None
        structured = structured_output(req, style, start_after or None)
        if structured is not None and self.grammar is not None:
            structured = compile_structured(self.grammar, structured, req)
        plan = OutputPlan(self.reasoning, thinking, parser, req.parallel_tool_calls is not False)
        return plan, structured
