"""OpenAI response shapes: ``ChatFormatter`` (``/v1/chat/completions``) and ``CompletionFormatter``
(``/v1/completions``) turn the worker's events into chunks and final responses.

Both share ``ResponseFormatter``: the response head (id, object, created, model), the accumulated ``Choice`` of
each index, usage and the ``dflash`` speculative summary. A subclass gives only what differs: the object names,
one choice of a chunk or of the final response, and the logprobs layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from dflash_core.stats import SpecSummary
from server.protocol import ChatCompletionRequest, CompletionRequest, now_ts, usage_dict

if TYPE_CHECKING:
    from dflash_core.detokenize import TokenStrings
    from dflash_core.engine import TokenLogprob
    from server.worker import WorkerEvent


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


class ResponseFormatter(ABC):
    """The response shapes of one HTTP request.

    Streams call ``chunk`` per event and end with ``usage_chunk`` when usage is asked for; non-streamed requests
    call ``accumulate`` per event and ``final`` once. Subclasses set ``object`` / ``chunk_object`` and implement
    ``_chunk_choice``, ``_final_choice`` and ``_logprobs``.
    """

    object: ClassVar[str]  # the non-streamed response's "object"
    chunk_object: ClassVar[str]  # each chunk's "object"
    announces_role: ClassVar[bool] = False  # the first chunk goes out even when empty (chat's role delta)

    def __init__(self, tokens: TokenStrings, rid: str, model: str, logprobs_on: bool) -> None:
        self.tokens = tokens
        self.rid = rid
        self.model = model
        self.created = now_ts()
        self.logprobs_on = logprobs_on

    # --- what a subclass gives ---------------------------------------------------------------------------

    @abstractmethod
    def _chunk_choice(self, ev: WorkerEvent, first: bool, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """One entry of a chunk's ``choices`` (``first``: the choice's first chunk)."""

    @abstractmethod
    def _final_choice(self, index: int, text: str, c: Choice, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """One entry of the final response's ``choices``."""

    @abstractmethod
    def _logprobs(self, c: Choice, items: list[TokenLogprob]) -> dict[str, Any]:
        """The ``logprobs`` object of ``items``, the next tokens of choice ``c``."""

    # --- shared ------------------------------------------------------------------------------------------

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _record(self, c: Choice, ev: WorkerEvent) -> None:
        c.text.append(ev.text)
        if ev.finish_reason is not None:
            c.finish_reason = ev.finish_reason
            c.completion_tokens = ev.completion_tokens
            c.spec = ev.spec or SpecSummary()

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
        if not (first and self.announces_role) and not ev.text and not lps and ev.finish_reason is None:
            return None
        c.sent_first = True
        lp_obj = self._logprobs(c, lps) if lps else None
        return {**self._head(self.chunk_object), "choices": [self._chunk_choice(ev, first, lp_obj)]}

    def _totals(self, choices: dict[int, Choice], prompt_tokens: int) -> dict[str, Any]:
        completion = sum(c.completion_tokens for c in choices.values())
        spec = sum((c.spec for c in choices.values()), SpecSummary())
        return {"usage": usage_dict(prompt_tokens, completion), "dflash": spec.to_dict()}

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

    def __init__(self, tokens: TokenStrings, rid: str, req: ChatCompletionRequest) -> None:
        super().__init__(tokens, rid, req.model, logprobs_on=req.logprobs)

    def _chunk_choice(self, ev: WorkerEvent, first: bool, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ev.text} if first else {"content": ev.text}
        return {"index": ev.index, "delta": delta, "logprobs": logprobs, "finish_reason": ev.finish_reason}

    def _final_choice(self, index: int, text: str, c: Choice, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
        }

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
        super().__init__(tokens, rid, req.model, logprobs_on=req.logprobs is not None)

    def _chunk_choice(self, ev: WorkerEvent, first: bool, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": ev.index, "text": ev.text, "logprobs": logprobs, "finish_reason": ev.finish_reason}

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
