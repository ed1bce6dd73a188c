"""A resumable scanner of one (possibly incomplete) JSON object at the start of a growing text: what the tool-call
parsers (``server/tools.py``) use to find a call's fields and its end as the model streams it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class InvalidCall(ValueError):
    """The text is not a JSON object."""


_WS = " \t\r\n"
_SCALAR_END = ",}] \t\r\n"


@dataclass
class Scan:
    """The keys of a top-level object seen so far: key -> (value start, value end or None)."""

    fields: dict[str, tuple[int, int | None]]
    end: int | None  # index after the closing brace, None while incomplete


class ObjectScanner:
    """A resumable scanner of one (possibly incomplete) JSON object at the start of a growing text.

    Each `scan` continues where the last one stopped (position, nesting depth, inside a string, after a
    backslash), so a call's text streamed in n pieces costs O(total length), not O(n * length). The text given
    to `scan` must extend the text given before. Lenient as the parser needs: values are delimited, not validated.
    """

    def __init__(self) -> None:
        self.fields: dict[str, tuple[int, int | None]] = {}
        self.end: int | None = None
        self._pos = 0
        self._state = "start"  # start, key_or_end, key, colon, value, string, nested, scalar, done
        self._token_start = 0  # the current key's or value's first character
        self._key = ""
        self._depth = 0
        self._in_string = False
        self._escape = False

    def scan(self, text: str) -> Scan:
        """The object's keys and end so far (InvalidCall when the text is not a JSON object)."""
        if self._state == "invalid":
            raise InvalidCall("not a JSON object")
        i, n = self._pos, len(text)
        state = self._state
        while i < n and state != "done":
            c = text[i]
            if state in ("string", "key", "nested") and (self._escape or self._in_string or state != "nested"):
                # inside a string: of a key, of a string value, or of a string within a nested value
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    if state == "key":
                        key = json_or_none(text[self._token_start : i + 1])
                        if not isinstance(key, str):
                            raise self._invalid("a key must be a string")
                        self._key, state = key, "colon"
                    elif state == "string":
                        self.fields[self._key] = (self._token_start, i + 1)
                        state = "key_or_end"
                    else:
                        self._in_string = False
                i += 1
            elif state == "nested":
                if c == '"':
                    self._in_string = True
                elif c in "{[":
                    self._depth += 1
                elif c in "}]":
                    self._depth -= 1
                    if self._depth == 0:
                        self.fields[self._key] = (self._token_start, i + 1)
                        state = "key_or_end"
                i += 1
            elif state == "scalar":
                if c in _SCALAR_END:
                    self.fields[self._key] = (self._token_start, i)
                    state = "key_or_end"  # the terminator is read again there
                else:
                    i += 1
            elif c in _WS:
                i += 1
            elif state == "start":
                if c != "{":
                    raise self._invalid("not a JSON object")
                state, i = "key_or_end", i + 1
            elif state == "key_or_end":
                if c == "}":
                    self.end, state = i + 1, "done"
                elif c == '"':
                    self._token_start, state = i, "key"
                elif c != ",":
                    raise self._invalid("a key must be a string")
                i += 1
            elif state == "colon":
                if c != ":":
                    raise self._invalid("':' expected after a key")
                state, i = "value", i + 1
            else:  # value: its first character
                self._token_start = i
                self.fields[self._key] = (i, None)
                if c == '"':
                    state = "string"
                elif c in "{[":
                    state, self._depth, self._in_string = "nested", 1, False
                else:
                    state = "scalar"
                    continue  # a one-character scalar may end here: read it again as a scalar
                i += 1
        self._pos, self._state = i, state
        return Scan(self.fields, self.end)

    def _invalid(self, why: str) -> InvalidCall:
        self._state = "invalid"
        return InvalidCall(why)


def scan_object(text: str) -> Scan:
    """Scan the (possibly incomplete) JSON object at the start of ``text`` (InvalidCall when it is not one)."""
    return ObjectScanner().scan(text)


def json_or_none(text: str) -> Any:
    """The JSON value of ``text``, or None when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
