"""OpenAI response shapes: ``ChatFormatter`` (``/v1/chat/completions``) and ``CompletionFormatter``
(``/v1/completions``) turn the worker's events into chunks and final responses.

Both share ``ResponseFormatter``: the response head (id, object, created, model), the accumulated ``Choice`` of
each index, usage and the ``dflash`` speculative summary. A subclass gives only what differs: the object names,
one choice of a chunk or of the final response, and the logprobs layout. Chat reads each choice's text through
its ``server.chat_output.ChatOutput`` (reasoning, content, tool calls; ``finish_reason`` "tool_calls" when the
answer is calls).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from dflash_core.stats import SpecSummary
from server.chat_output import ChatDelta, ChatOutput, OutputPlan
from server.chat_request import ChatCompletionRequest
from server.completion_request import CompletionRequest
from server.protocol import now_ts, usage_dict

if TYPE_CHECKING:
    from dflash_core.detokenize import TokenStrings
    from dflash_core.outputs import TokenLogprob
    from server.handoff import WorkerEvent


@dataclass
class Choice:
    """Accumulated output of one choice."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    spec: SpecSummary = field(default_factory=SpecSummary)
    sent_first: bool = False
    text_offset: int = 0  # characters of the text so far (completion logprobs' text_offset)
    output: ChatOutput | None = None  # chat: the reader of reasoning and tool calls
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (on the last event)
    streamed_tokens: int = 0  # completion tokens of the events so far


class ResponseFormatter(ABC):
    """The response shapes of one HTTP request.

    Streams call ``chunk`` per event and end with ``usage_chunk`` when usage is asked for; non-streamed requests
    call ``accumulate`` per event and ``final`` once. Subclasses set ``object`` / ``chunk_object`` and implement
    ``_chunk_choice``, ``_final_choice`` and ``_logprobs``.
    """

    object: ClassVar[str]  # the non-streamed response's "object"
    chunk_object: ClassVar[str]  # each chunk's "object"
    announces_role: ClassVar[bool] = False  # the first chunk goes out even when empty (chat's role delta)

    def __init__(self, tokens: TokenStrings, rid: str, model: str, logprobs_on: bool, n: int = 1) -> None:
        self.tokens = tokens
        self.n = max(1, n)  # choices per prompt: choice index // n is its prompt
        self.rid = rid
        self.model = model
        self.created = now_ts()
        self.logprobs_on = logprobs_on

    # --- what a subclass gives ---------------------------------------------------------------------------

    @abstractmethod
    def _chunk_fields(self, c: Choice, ev: WorkerEvent, first: bool) -> tuple[dict[str, Any], bool]:
        """The text fields of a chunk's choice (``first``: the choice's first chunk), and whether they are empty."""

    @abstractmethod
    def _final_choice(self, index: int, text: str, c: Choice, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """One entry of the final response's ``choices``."""

    @abstractmethod
    def _logprobs(self, c: Choice, items: list[TokenLogprob]) -> dict[str, Any]:
        """The ``logprobs`` object of ``items``, the next tokens of choice ``c``."""

    # --- shared ------------------------------------------------------------------------------------------

    def new_choice(self) -> Choice:
        """The accumulator of one choice."""
        return Choice()

    def _finish_reason(self, c: Choice, reason: str | None) -> str | None:
        """The finish reason the client sees."""
        return reason

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _record(self, c: Choice, ev: WorkerEvent) -> None:
        c.text.append(ev.text)
        c.streamed_tokens += ev.num_tokens
        if ev.finish_reason is not None:
            c.finish_reason = ev.finish_reason
            c.completion_tokens = ev.completion_tokens
            c.spec = ev.spec or SpecSummary()
            c.cached_tokens = ev.cached_tokens

    def accumulate(self, c: Choice, ev: WorkerEvent) -> None:
        """Add an event to a non-streamed choice."""
        self._record(c, ev)
        if self.logprobs_on and ev.logprobs:
            c.logprobs.extend(ev.logprobs)

    def chunk(self, c: Choice, ev: WorkerEvent) -> dict[str, Any] | None:
        """The SSE chunk for one event (None when the step added nothing visible)."""
        self._record(c, ev)
        lps = ev.logprobs if self.logprobs_on and ev.logprobs else None
        first = not c.sent_first
        fields, empty = self._chunk_fields(c, ev, first)
        if not (first and self.announces_role) and empty and not lps and ev.finish_reason is None:
            return None
        c.sent_first = True
        lp_obj = self._logprobs(c, lps) if lps else None
        choice = {
            "index": ev.index,
            **fields,
            "logprobs": lp_obj,
            "finish_reason": self._finish_reason(c, ev.finish_reason),
        }
        return {**self._head(self.chunk_object), "choices": [choice]}

    def _totals(self, choices: dict[int, Choice], prompt_tokens: int) -> dict[str, Any]:
        completion = sum(c.completion_tokens for c in choices.values())
        spec = sum((c.spec for c in choices.values()), SpecSummary())
        # OpenAI's usage.prompt_tokens_details.cached_tokens: each prompt counts once in prompt_tokens, so once
        # here too, with what every choice of it got from the prefix cache (the least of them)
        per_prompt: dict[int, int] = {}
        for index, c in choices.items():
            group = index // self.n
            per_prompt[group] = min(per_prompt.get(group, c.cached_tokens), c.cached_tokens)
        usage = {**usage_dict(prompt_tokens, completion),
                 "prompt_tokens_details": {"cached_tokens": sum(per_prompt.values())}}
        return {"usage": usage, "dflash": spec.to_dict()}

    def usage_chunk(self, choices: dict[int, Choice], prompt_tokens: int) -> dict[str, Any]:
        """The final ``choices: []`` chunk with usage and the speculative summary."""
        return {**self._head(self.chunk_object), "choices": [], **self._totals(choices, prompt_tokens)}

    def final(self, choices: dict[int, Choice], prompt_tokens: int) -> dict[str, Any]:
        """The non-streamed response."""
        out = []
        for index in sorted(choices):
            c = choices[index]
            lp_obj = self._logprobs(c, c.logprobs) if self.logprobs_on else None
            out.append(self._final_choice(index, "".join(c.text), c, lp_obj))
        return {**self._head(self.object), "choices": out, **self._totals(choices, prompt_tokens)}


class ChatFormatter(ResponseFormatter):
    """``chat.completion`` / ``chat.completion.chunk``: a message, deltas (the first one with the role), and
    logprobs as ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    announces_role = True

    def __init__(self, tokens: TokenStrings, rid: str, req: ChatCompletionRequest, plan: OutputPlan) -> None:
        super().__init__(tokens, rid, req.model, logprobs_on=req.logprobs, n=req.n)
        self.plan = plan

    def new_choice(self) -> Choice:
        return Choice(output=self.plan.output())

    def _finish_reason(self, c: Choice, reason: str | None) -> str | None:
        if reason == "stop" and c.output is not None and c.output.tool_calls:
            return "tool_calls"
        return reason

    def _chunk_fields(self, c: Choice, ev: WorkerEvent, first: bool) -> tuple[dict[str, Any], bool]:
        assert c.output is not None
        d: ChatDelta = c.output.feed(ev.text)
        if ev.finish_reason is not None:
            d = d + c.output.finish()
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if d.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = d.reasoning
        if d.content or not (d.reasoning or d.tool_calls):
            delta["content"] = d.content
        if d.tool_calls:
            delta["tool_calls"] = [t.to_dict() for t in d.tool_calls]
        return {"delta": delta}, not (d.reasoning or d.content or d.tool_calls)

    def _final_choice(self, index: int, text: str, c: Choice, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        output = self.plan.output()
        parts = output.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": parts.content}
        if self.plan.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = parts.reasoning or None
        if parts.tool_calls:
            message["tool_calls"] = [t.to_dict() for t in parts.tool_calls]
        if parts.tool_calls or parts.reasoning or self.plan.forced_tools:  # OpenAI's null: calls or thinking only
            message["content"] = parts.content or None
        reason = "tool_calls" if parts.tool_calls and c.finish_reason == "stop" else c.finish_reason
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def _logprobs(self, c: Choice, items: list[TokenLogprob]) -> dict[str, Any]:
        return {
            "content": [
                {**self._token(lp.token_id, lp.logprob), "top_logprobs": [self._token(t, v) for t, v in lp.top]}
                for lp in items
            ]
        }

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.tokens.text(token_id),
            "logprob": logprob,
            "bytes": list(self.tokens.bytes(token_id)),
        }


class CompletionFormatter(ResponseFormatter):
    """``text_completion`` (chunks too): text, and logprobs as parallel lists with character offsets."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokens: TokenStrings, rid: str, req: CompletionRequest) -> None:
        super().__init__(tokens, rid, req.model, logprobs_on=req.logprobs is not None, n=req.n)

    def _chunk_fields(self, c: Choice, ev: WorkerEvent, first: bool) -> tuple[dict[str, Any], bool]:
        return {"text": ev.text}, not ev.text

    def _final_choice(self, index: int, text: str, c: Choice, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def _logprobs(self, c: Choice, items: list[TokenLogprob]) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in items:
            text = self.tokens.text(lp.token_id)
            tokens.append(text)
            token_lps.append(lp.logprob)
            tops.append({self.tokens.text(t): v for t, v in lp.top})
            offsets.append(c.text_offset)
            c.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
