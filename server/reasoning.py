"""Reasoning parsers: the model's thinking text goes to ``reasoning_content`` (and ``reasoning``), the rest to
``content``, in whole responses and in stream deltas (``--reasoning-parser``).

Both styles read ``<think>`` … ``</think>``; they differ in where the output starts:

- ``qwen3`` (Qwen3, Qwen3.5, Qwen3.6): in the answer, unless the prompt opened thinking (a generation prompt that
  ends with ``<think>``, as Qwen3.5's does); a ``<think>`` in the output opens the reasoning.
- ``deepseek_r1``: in the reasoning (the R1 template opens it), a leading ``<think>`` dropped; output without
  ``</think>`` is all reasoning.

In both, a prompt that already closed thinking (``enable_thinking: false`` renders ``<think>\\n\\n</think>``)
starts in the answer. The split works on text as it arrives: a marker split across engine steps is held back
until it is complete, and one step that carries the end of the reasoning and the start of the answer is split
inside its delta. Parsing the whole text at once (``split``) gives the same result as feeding it in pieces.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from dflash_core.tool_grammar import THINK_END, THINK_START


class PromptThinking(Enum):
    """Where the prompt leaves the model's thinking."""

    OPEN = "open"  # the prompt ends inside a reasoning block: the output starts with reasoning
    CLOSED = "closed"  # the prompt closed it (thinking disabled): the output is the answer
    NONE = "none"  # no marker at the end: the model decides


def prompt_thinking(prompt_tail: str) -> PromptThinking:
    """Classify the end of a rendered prompt (its last few tokens as text)."""
    tail = prompt_tail.rstrip()
    if tail.endswith(THINK_START):
        return PromptThinking.OPEN
    if tail.endswith(THINK_END):
        return PromptThinking.CLOSED
    return PromptThinking.NONE


@dataclass
class ReasoningDelta:
    """Text of one piece of output, split."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(self.reasoning + other.reasoning, self.content + other.content)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker`` (held back until known)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """One choice's output split into reasoning and answer, text piece by text piece."""

    def __init__(self, in_reasoning: bool, drop_leading_start: bool, may_open: bool = True) -> None:
        self._in_reasoning = in_reasoning
        self._opened = in_reasoning or not may_open  # a reasoning block has started (only one per answer)
        self._closed = False
        self._drop_start = drop_leading_start and in_reasoning  # R1: a leading <think> repeats the prompt's
        self._seen_text = False  # reasoning text seen (a <think> after it is text)
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the output so far ends inside the reasoning."""
        return self._in_reasoning

    def feed(self, text: str) -> ReasoningDelta:
        """Split the next piece of output; a marker's incomplete start is held until the next piece."""
        self._buf += text
        out = ReasoningDelta()
        while self._buf:
            if self._in_reasoning:
                if self._drop_start and not self._seen_text:
                    stripped = self._buf.lstrip()
                    if stripped.startswith(THINK_START):
                        self._buf = stripped[len(THINK_START):]
                        self._drop_start = False
                        continue
                    if THINK_START.startswith(stripped):
                        return out  # maybe the start of a leading <think>
                    self._drop_start = False
                i = self._buf.find(THINK_END)
                if i >= 0:
                    out.reasoning += self._buf[:i]
                    self._buf = self._buf[i + len(THINK_END):]
                    self._in_reasoning, self._closed = False, True
                    continue
                keep = _held_prefix(self._buf, THINK_END)
                emit = self._buf[: len(self._buf) - keep]
                out.reasoning += emit
                self._seen_text |= bool(emit.strip())
                self._buf = self._buf[len(emit):]
                return out
            if self._opened or self._closed:  # the reasoning is over: everything else is the answer
                out.content += self._buf
                self._buf = ""
                return out
            i = self._buf.find(THINK_START)
            if i >= 0:
                out.content += self._buf[:i]
                self._buf = self._buf[i + len(THINK_START):]
                self._in_reasoning = self._opened = True
                continue
            keep = _held_prefix(self._buf, THINK_START)
            out.content += self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            return out
        return out

    def finish(self) -> ReasoningDelta:
        """The text still held at the end of the output (an incomplete marker is plain text)."""
        held, self._buf = self._buf, ""
        return ReasoningDelta(reasoning=held) if self._in_reasoning else ReasoningDelta(content=held)

    def split(self, text: str) -> ReasoningDelta:
        """A whole output at once (the same split as feeding it in pieces)."""
        return self.feed(text) + self.finish()


class ReasoningStyle(ABC):
    """A ``--reasoning-parser``: how a request's output starts, given its prompt."""

    name: ClassVar[str]
    end_marker: ClassVar[str] = THINK_END
    drops_leading_start: ClassVar[bool] = False  # a leading <think> in the output is dropped (it repeats the prompt's)

    @abstractmethod
    def starts_in_reasoning(self, prompt: PromptThinking) -> bool:
        """Whether the output begins inside the reasoning."""

    def splitter(self, prompt: PromptThinking) -> ReasoningSplitter:
        """A fresh splitter for one choice of a request with this prompt."""
        return ReasoningSplitter(
            self.starts_in_reasoning(prompt),
            drop_leading_start=self.drops_leading_start,
            may_open=prompt is not PromptThinking.CLOSED,  # thinking disabled: a <think> is text
        )


class Qwen3Style(ReasoningStyle):
    """Qwen3 / Qwen3.5 / Qwen3.6: reasoning only inside ``<think>`` … ``</think>`` (or after a prompt's ``<think>``)."""

    name = "qwen3"

    def starts_in_reasoning(self, prompt: PromptThinking) -> bool:
        return prompt is PromptThinking.OPEN


class DeepSeekR1Style(ReasoningStyle):
    """DeepSeek-R1: the output starts in the reasoning, up to ``</think>``."""

    name = "deepseek_r1"
    drops_leading_start = True

    def starts_in_reasoning(self, prompt: PromptThinking) -> bool:
        return prompt is not PromptThinking.CLOSED


REASONING_STYLES: dict[str, type[ReasoningStyle]] = {s.name: s for s in (Qwen3Style, DeepSeekR1Style)}


def reasoning_style(name: str) -> ReasoningStyle:
    """The style of ``--reasoning-parser NAME`` (ValueError naming the known ones)."""
    try:
        return REASONING_STYLES[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_STYLES)}") from None
