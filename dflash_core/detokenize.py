"""Incremental detokenization (UTF-8 safe) and stop strings.

``IncrementalDetokenizer`` turns token ids into text one token at a time. It decodes a short window
of recent tokens twice (with and without the newest ones) and emits the difference, so spacing rules
of the tokenizer are kept; text that ends in U+FFFD (a character whose bytes are split across tokens)
is held until the character is complete.

``StopMatcher`` cuts text exactly before the first stop string and holds back any tail that could
still become one.

``RequestDecoder`` combines both for one request and says how many tokens were used when a stop
string ended the text; ``OutputText`` applies it to the engine's step outputs (the stop token's text is not
output; a stop string ends the request), for the server's worker and for ``LLM``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_core.outputs import StepOutput

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Token ids in, complete text out (never a split character until ``flush``).

    A fast (tokenizers-backed) tokenizer streams through the tokenizers library's ``DecodeStream``, primed with the
    prompt's last tokens: one cheap step per token. Other tokenizers decode a short window twice per token.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        from transformers import PreTrainedTokenizerFast

        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list((prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stream: Any = None
        if isinstance(tokenizer, PreTrainedTokenizerFast):
            from tokenizers.decoders import DecodeStream

            self._backend = tokenizer.backend_tokenizer
            self._stream = DecodeStream(ids=list(self._ids), skip_special_tokens=skip_special_tokens)
            self._pending = 0  # tokens the stream holds (an incomplete character)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        if self._stream is None:
            return self._advance(final=False)
        text = self._stream.step(self._backend, token_id)
        if text is None:
            self._pending += 1
            return ""
        self._pending = 0
        self._read_offset = len(self._ids)
        return text

    def flush(self) -> str:
        """Text still held at the end of the stream (an incomplete character becomes U+FFFD)."""
        if self._stream is not None:
            if not self._pending:
                return ""
            self._prefix_offset = max(0, len(self._ids) - self._pending - PROMPT_CONTEXT_TOKENS)
            self._read_offset = len(self._ids) - self._pending
            self._pending = 0
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


class StopMatcher:
    """Finds stop strings in a text stream; holds back a tail that may start one. The text ends before the stop
    string, or after it with ``include_stop`` (vLLM's ``include_stop_str_in_output``)."""

    def __init__(self, stop: list[str], include_stop: bool = False) -> None:
        self._stop = [s for s in stop if s]
        self._include = include_stop
        self._max = max((len(s) for s in self._stop), default=0)
        self._held = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit, the stop string found or None)."""
        if not self._stop:
            return text, None
        buf = self._held + text
        best = -1
        found: str | None = None
        for s in self._stop:
            i = buf.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, found = i, s
        if found is not None:
            self._held = ""
            return buf[: best + (len(found) if self._include else 0)], found
        hold = 0
        for k in range(min(len(buf), self._max - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stop):
                hold = k
                break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """The held tail, released when the stream ends without a stop string."""
        out, self._held = self._held, ""
        return out


@dataclass
class DecodeResult:
    """What one engine step adds to a request's output."""

    text: str = ""
    tokens_used: int = 0  # tokens of the input that count (all unless a stop string cut)
    stop_string: str | None = None  # the stop string that ended the text


class RequestDecoder:
    """Detokenizer + stop strings for one request."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int] | None,
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = StopMatcher(stop, include_stop)
        self.stopped = False

    def feed(self, token_ids: list[int]) -> DecodeResult:
        """Feed the tokens of one step (EOS / stop token ids excluded)."""
        res = DecodeResult()
        if self.stopped:
            return res
        parts: list[str] = []
        for i, tid in enumerate(token_ids):
            out, stop = self._stop.push(self._detok.add_token(tid))
            parts.append(out)
            if stop is not None:
                self.stopped = True
                res.stop_string = stop
                res.tokens_used = i + 1
                break
        else:
            res.tokens_used = len(token_ids)
        res.text = "".join(parts)
        return res

    def finish(self) -> DecodeResult:
        """End of stream: flush held bytes and any held stop-string prefix."""
        res = DecodeResult()
        if self.stopped:
            return res
        out, stop = self._stop.push(self._detok.flush())
        if stop is not None:
            self.stopped = True
            res.stop_string = stop
            res.text = out
            return res
        res.text = out + self._stop.flush()
        return res


@dataclass
class TextStep:
    """What one engine step adds to a request's visible output."""

    text: str
    token_ids: list[int]  # the step's tokens up to a stop string's end (all when none)
    num_text_tokens: int  # of those, the ones that are text (a stop token is not): they carry logprobs
    finish_reason: str | None  # the engine's, or "stop" when a stop string ended the text
    stopped_early: bool = False  # a stop string ended it while the engine is still generating: abort it


@dataclass
class OutputText:
    """One request's text as the engine's steps arrive: detokenized, stop strings applied, stop token hidden."""

    tokenizer: Any
    prompt_token_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True  # special tokens' text left out (vLLM's default)
    include_stop: bool = False  # a stop string stays in the text (vLLM's include_stop_str_in_output)

    def __post_init__(self) -> None:
        self._decoder = RequestDecoder(
            self.tokenizer, self.prompt_token_ids, list(self.stop), self.skip_special_tokens, self.include_stop
        )

    def step(self, out: StepOutput) -> TextStep:
        """The text and tokens of one step output (not an error or abort output)."""
        tokens = list(out.new_token_ids)
        text_tokens = tokens[:-1] if out.stop_token_id is not None and tokens else tokens
        res = self._decoder.feed(text_tokens)
        if res.stop_string is not None:
            return TextStep(res.text, tokens[: res.tokens_used], res.tokens_used, "stop",
                            stopped_early=out.finish_reason is None)
        text, finish = res.text, out.finish_reason
        if finish is not None:
            tail = self._decoder.finish()
            text += tail.text
            if tail.stop_string is not None:
                finish = "stop"
        return TextStep(text, tokens, len(text_tokens), finish)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table used by byte-level BPE vocabularies."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        return '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))
    except (ValueError, TypeError, AttributeError):
        return False


class TokenStrings:
    """The exact bytes of single tokens (for logprobs), and their text (U+FFFD for a partial character)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def text(self, token_id: int) -> str:
        """The token as text (lossy for a partial UTF-8 character)."""
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def _compute(self, token_id: int) -> bytes:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode("utf-8")
        if self._byte_level and all(ch in _UNICODE_TO_BYTE for ch in piece):
            return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if piece.startswith("\u2581") or "\u2581" in piece:  # SentencePiece word boundary
            return piece.replace("\u2581", " ").encode("utf-8")
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
