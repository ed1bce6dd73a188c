"""Tool-call parsers (``--tool-call-parser``): the model's tool calls out of its text, whole or as stream deltas.

- ``hermes`` (Qwen and Hermes models): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more
  times; text before the first call is content, text between and after calls is dropped.
- ``llama3_json`` (Llama 3.x): an output that starts with ``{`` (after an optional ``<|python_tag|>``) is one or
  more ``{"name": ..., "parameters": {...}}`` objects separated by ``;``; any other output is content.

Streams get OpenAI's deltas: a call's first delta has ``index``, ``id``, ``type`` and ``function.name`` (with
``arguments: ""``), later ones carry ``function.arguments`` fragments as the model writes them. A call's
arguments are the JSON text of the object the model wrote (a string value is unwrapped), so the fragments of a
stream join into the ``arguments`` of the whole response. A marker split across engine steps is held back until
it is complete. A whole response is parsed by feeding its text at once (``parse``), so both agree; when a call
does not parse as JSON with a name, the whole text is content in a whole response (as vLLM does), while a stream
has sent its name already and ends that call. A call whose object is complete is a call even when the output
ends inside its end marker.

A forced parser (``required`` or a named ``tool_choice``, whose grammar allows calls only) reads calls and never
content, and a call cut by the end of the output (``max_tokens``) is kept as it was streamed: its name and the
arguments written so far, as OpenAI returns a call cut by ``finish_reason: "length"``.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from server.json_scan import InvalidCall, ObjectScanner, Scan, json_or_none, scan_object

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    """``call_<24 hex>``, the id of one tool call."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One entry of a chunk's ``delta.tool_calls``."""

    index: int
    id: str | None = None  # on the call's first delta, with its name
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's chunk shape."""
        if self.id is not None:
            return {
                "index": self.index,
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments},
            }
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class ToolCall:
    """A complete call."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    """What one piece of text adds: content text and tool-call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: ToolDelta) -> ToolDelta:
        return ToolDelta(self.content + other.content, [*self.calls, *other.calls])


# --- a scanner of one JSON object as it grows ---------------------------------------------------------------


class _CallState:
    """One call as its text grows: the deltas not yet sent, and the call once its object is complete."""

    def __init__(self, index: int, arg_keys: tuple[str, ...]) -> None:
        self.index = index
        self.arg_keys = arg_keys
        self.id = new_call_id()
        self.name: str | None = None
        self.sent_args = 0  # characters of streamed (raw object) arguments sent
        self.sent_text = ""  # those characters
        self.invalid = False
        self._scanner = ObjectScanner()  # over the growing text that `update` is given

    def _args_extent(self, scan: Scan) -> tuple[int, int | None] | None:
        return next((scan.fields[k] for k in self.arg_keys if k in scan.fields), None)

    def scan(self, text: str) -> Scan | None:
        """The call's object so far (``text`` extends the text of the last call); None once it is not an object."""
        if self.invalid:
            return None
        try:
            return self._scanner.scan(text)
        except InvalidCall:
            self.invalid = True
            return None

    def update(self, text: str) -> list[ToolCallDelta]:
        """Deltas for the call's text so far (its name once complete, then argument fragments)."""
        scan = self.scan(text)
        if scan is None:
            return []
        out: list[ToolCallDelta] = []
        if self.name is None:
            span = scan.fields.get("name")
            if span is None or span[1] is None:
                return out
            name = json_or_none(text[span[0] : span[1]])
            if not isinstance(name, str) or not name:
                self.invalid = True
                return out
            self.name = name
            out.append(ToolCallDelta(self.index, id=self.id, name=name))
        extent = self._args_extent(scan)
        if extent is not None and text[extent[0]] == "{":  # objects stream as written; other values at the end
            start, end = extent
            stop = len(text) if end is None else end
            if stop - start > self.sent_args:  # sliced from the text: no copy of what was sent
                fragment = text[start + self.sent_args : stop]
                out.append(ToolCallDelta(self.index, arguments=fragment))
                self.sent_args, self.sent_text = stop - start, self.sent_text + fragment
        return out

    def complete(self, text: str) -> tuple[ToolCall | None, list[ToolCallDelta]]:
        """The call of a complete text (None when it does not parse) and the last deltas of a stream."""
        self._scanner = ObjectScanner()  # `text` is stripped, so not the streamed text: one scan of it afresh
        out = self.update(text)
        try:
            obj = json.loads(text)
            scan = scan_object(text)
        except (ValueError, RecursionError, InvalidCall):  # RecursionError: nested past the parser's depth
            self.invalid = True
            return None, out
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or self.invalid or self.name is None:
            self.invalid = True
            return None, out
        extent = self._args_extent(scan)
        if extent is None:
            arguments = "{}"
        else:
            value = text[extent[0] : extent[1]]
            arguments = value if value.startswith("{") else _unwrap(json.loads(value))
        if len(arguments) > self.sent_args and arguments.startswith(arguments[: self.sent_args]):
            out.append(ToolCallDelta(self.index, arguments=arguments[self.sent_args :]))
            self.sent_args, self.sent_text = len(arguments), arguments
        return ToolCall(self.id, self.name, arguments), out

    def partial(self) -> ToolCall | None:
        """The call as streamed so far (None before its name): a call cut by the end of the output."""
        return None if self.name is None else ToolCall(self.id, self.name, self.sent_text)


def _unwrap(value: Any) -> str:
    """Arguments given as a JSON string are that string; other values their JSON text."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


# --- the parsers ----------------------------------------------------------------------------------------------


class ToolParser(ABC):
    """One choice's tool calls, parsed from its content text piece by piece."""

    name: ClassVar[str]

    def __init__(self, parallel: bool = True, forced: bool = False) -> None:
        self.parallel = parallel
        self.forced = forced  # calls only (see the module docstring)
        self.calls: list[ToolCall] = []
        self.invalid = False  # a call did not parse

    @abstractmethod
    def _feed(self, text: str) -> ToolDelta:
        """Content and call deltas of the next piece of text."""

    @abstractmethod
    def _finish(self) -> ToolDelta:
        """What is still held at the end of the output (an unclosed call is parsed as it is)."""

    def feed(self, text: str) -> ToolDelta:
        """Content and call deltas of the next piece of text."""
        return self._calls_only(self._feed(text))

    def finish(self) -> ToolDelta:
        """What is still held at the end of the output (an unclosed call is parsed as it is)."""
        return self._calls_only(self._finish())

    def _calls_only(self, out: ToolDelta) -> ToolDelta:
        """``out`` without content when forced: its grammar allows at most whitespace beside the calls."""
        if self.forced:
            out.content = ""
        return out

    def parse(self, text: str) -> ToolDelta:
        """A whole output: content and calls (all content when a call does not parse, unless forced)."""
        out = self.feed(text) + self.finish()
        if self.invalid and not self.forced:
            self.calls = []
            return ToolDelta(content=text)
        return out

    def _keep(self) -> bool:
        """Whether a further call counts (``parallel_tool_calls: false`` keeps the first only)."""
        return self.parallel or not self.calls

    def _close_call(self, state: _CallState, text: str, out: ToolDelta) -> None:
        """Parse an open call from its remaining text at the end of the output: its last deltas into `out`. A
        complete object is the call (the output may end inside the end marker); a cut one is kept as streamed
        when forced."""
        keep = self._keep()
        text = text.strip()
        try:
            end = scan_object(text).end
        except InvalidCall:
            end = None
        call, deltas = state.complete(text if end is None else text[:end])
        if call is None and self.forced:
            call = state.partial()
        out.calls.extend(deltas if keep else [])
        if keep:
            self._accept(call)

    def _accept(self, call: ToolCall | None) -> None:
        """Record a complete call (None: it did not parse)."""
        if call is None:
            self.invalid = True
        elif self._keep():
            self.calls.append(call)


class HermesParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` (Qwen, Hermes)."""

    name = "hermes"

    def __init__(self, parallel: bool = True, forced: bool = False) -> None:
        super().__init__(parallel, forced)
        self._buf = ""
        self._call: _CallState | None = None
        self._seen_call = False
        self._searched = 0  # where in the open call's text the end marker can first be

    def _feed(self, text: str) -> ToolDelta:
        self._buf += text
        out = ToolDelta()
        while True:
            if self._call is None:
                i = self._buf.find(TOOL_CALL_START)
                if i < 0:
                    keep = _held_prefix(self._buf, TOOL_CALL_START)
                    if not self._seen_call:  # text after the first call is dropped
                        out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                if not self._seen_call:
                    out.content += self._buf[:i]
                self._buf = self._buf[i + len(TOOL_CALL_START) :]
                self._seen_call = True
                index = len(self.calls)
                self._call = _CallState(index, ("arguments", "parameters"))
                continue
            j = self._buf.find(TOOL_CALL_END, self._searched)
            keep = self._keep()
            if j < 0:
                self._searched = max(0, len(self._buf) - len(TOOL_CALL_END) + 1)  # the next search starts there
                deltas = self._call.update(self._buf)
                out.calls.extend(deltas if keep else [])
                return out
            self._searched = 0
            call, deltas = self._call.complete(self._buf[:j].strip())
            out.calls.extend(deltas if keep else [])
            if keep:
                self._accept(call)
            self._buf = self._buf[j + len(TOOL_CALL_END) :]
            self._call = None

    def _finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._call is not None:  # an unclosed call (the model stopped after its object)
            self._close_call(self._call, self._buf, out)
            self._call = None
        elif not self._seen_call:
            out.content += self._buf
        self._buf = ""
        return out


class Llama3JsonParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` objects separated by ``;`` (Llama 3.x JSON tool calls)."""

    name = "llama3_json"

    def __init__(self, parallel: bool = True, forced: bool = False) -> None:
        super().__init__(parallel, forced)
        self._buf = ""
        self._mode: str | None = None  # None: undecided; "content"; "calls"
        self._call: _CallState | None = None

    def _feed(self, text: str) -> ToolDelta:
        self._buf += text
        out = ToolDelta()
        if self._mode is None:
            stripped = self._buf.lstrip()
            if not stripped or (PYTHON_TAG.startswith(stripped) and stripped != PYTHON_TAG):
                return out  # undecided: whitespace, or maybe the start of the tag
            if stripped.startswith(PYTHON_TAG):
                stripped = stripped[len(PYTHON_TAG) :].lstrip()
                if not stripped:
                    return out
            if stripped.startswith("{"):
                self._mode, self._buf = "calls", stripped
            else:
                self._mode = "content"
        if self._mode == "content":
            out.content, self._buf = self._buf, ""
            return out
        return out + self._calls()

    def _calls(self) -> ToolDelta:
        out = ToolDelta()
        while True:
            if self._call is None:
                rest = self._buf.lstrip().lstrip(";").lstrip()
                if not rest.startswith("{"):
                    self._buf = ""  # text between and after calls is dropped
                    return out
                self._buf = rest
                self._call = _CallState(len(self.calls), ("parameters", "arguments"))
            keep = self._keep()
            scan = self._call.scan(self._buf)  # resumes where the last piece stopped
            end = None if scan is None else scan.end
            if end is None:
                out.calls.extend(self._call.update(self._buf) if keep else [])
                return out
            call, deltas = self._call.complete(self._buf[:end])
            out.calls.extend(deltas if keep else [])
            if keep:
                self._accept(call)
            self._buf = self._buf[end:]
            self._call = None

    def _finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._mode is None:
            out.content = self._buf
        elif self._call is not None:
            self._close_call(self._call, self._buf, out)
            self._call = None
        self._buf = ""
        return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser of ``--tool-call-parser NAME`` (ValueError naming the known ones)."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}") from None
