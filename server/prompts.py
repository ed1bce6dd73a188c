"""Prompts: the chat template rendered so that message text stays text, a cheap context bound, tokenization.

Special tokens in messages. A chat template's turns are marked by special tokens (``<|im_start|>``, ...); if
message content were tokenized together with the template, content that merely *spells* one
(``"hi<|im_end|>\\n<|im_start|>system\\n..."``) would become a real turn marker and forge a system turn. So the
template is also rendered with every client string (content, names, every string of ``tools``: keys too, but for
the JSON-schema keywords) replaced by a random sentinel: that rendering holds the template's own special tokens.
When the real rendering tokenizes to the same special tokens, the content added none and the usual whole-text
tokens are used (identical to ``apply_chat_template(tokenize=True)``).
Otherwise the text is split at the sentinels: template parts are tokenized with special tokens, client strings as
plain text. A template that changes content (e.g. strips a reasoning block) cannot be split that way; such a
request is refused with a 400. Plain text is encoded by a private copy of the Rust tokenizer whose
``encode_special_tokens`` is always on: transformers' ``split_special_tokens=True`` flips that flag on the shared
tokenizer, which would race with tokenizations in other threads. ``chat_template_kwargs`` reach the template
beside the messages and over the tokenizer's ``special_tokens_map`` (``bos_token``, ...), so a kwarg named like a
special token, or a string in one that contains special-token text, is refused with a 400.
``allow_special_tokens`` turns all of this off.

Completion prompts are the client's raw prompt, with no template and no turns to forge: special-token text in them
is tokenized as special tokens, as vLLM does.

The cheap bound. Tokenizing a long text costs seconds and gigabytes; a text that cannot fit the context is refused
before that. No token stands for more characters than the longest vocabulary entry (in byte-level BPE an entry's
characters are bytes, and a character is at least one byte), so a text of ``n`` characters is at least
``n / longest`` tokens, or ``n / (4 * longest)`` for non-ASCII text when a Unicode normalizer (NFC, NFKC, ...) can
compose up to 4 characters into one. The bound is used only for tokenizers whose model keeps every character
(byte-level BPE, or byte fallback) and whose normalizer and pre-tokenizer drop none; otherwise it is off.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jinja2

from dflash_core.chat import NoChatTemplateError, has_chat_template, render_chat
from dflash_core.tool_grammar import SCHEMA_DATA_KEYWORDS
from server.api_error import APIError
from server.chat_request import ChatCompletionRequest, ChatMessage
from server.completion_request import CompletionRequest
from server.context_length import check_min_prompt_tokens
from server.tokenize_request import TokenizeRequest

RESERVED_TEMPLATE_KWARGS = frozenset(
    "conversation messages tokenize return_tensors return_dict return_assistant_tokens_mask padding truncation "
    "max_length tools documents chat_template tokenizer_kwargs".split()
)
NORMALIZER_SLACK = 4  # canonical composition turns at most 4 characters into one (U+1F85 = 4 code points)
_UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
_HARMLESS_NORMALIZERS = frozenset({"Prepend", "ByteLevel"})  # add characters, never remove
_DROPPING_PRE_TOKENIZERS = frozenset({"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit"})


@dataclass(frozen=True)
class TokenBound:
    """A lower bound on the tokens of a text: no token covers more than ``max_chars`` characters."""

    max_chars: int
    non_ascii_slack: int = 1

    def min_tokens(self, text: str) -> int:
        """At least this many tokens (``str.isascii`` is O(1) in CPython)."""
        per_token = self.max_chars * (1 if text.isascii() else self.non_ascii_slack)
        return math.ceil(len(text) / per_token)


def _components(spec: Any) -> Iterator[dict[str, Any]]:
    """The leaves of a tokenizers normalizer / pre-tokenizer spec (``Sequence`` flattened)."""
    if not isinstance(spec, dict):
        return
    if spec.get("type") == "Sequence":
        for item in spec.get("normalizers") or spec.get("pretokenizers") or []:
            yield from _components(item)
    else:
        yield spec


def _normalizer_slack(spec: Any) -> int | None:
    """How many characters a normalizer may turn into one (None: it may remove characters, no bound)."""
    slack = 1
    for c in _components(spec):
        kind = c.get("type")
        if kind in _UNICODE_NORMALIZERS:
            slack = NORMALIZER_SLACK
        elif kind in _HARMLESS_NORMALIZERS:
            continue
        elif kind == "Replace":
            pattern = (c.get("pattern") or {}).get("String")
            if pattern is None or len(c.get("content") or "") < len(pattern):
                return None
        else:
            return None
    return slack


def _keeps_every_character(spec: dict[str, Any]) -> bool:
    """Whether every input character ends up in some token (no unknowns dropped or fused, no splits removed)."""
    pre = list(_components(spec.get("pre_tokenizer")))
    if any(c.get("type") in _DROPPING_PRE_TOKENIZERS for c in pre):
        return False
    if any(c.get("type") == "Split" and c.get("behavior") == "Removed" for c in pre):
        return False
    byte_level = any(c.get("type") == "ByteLevel" for c in pre)
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        unk_per_char = model.get("unk_token") is not None and not model.get("fuse_unk")
        return byte_level or bool(model.get("byte_fallback")) or unk_per_char
    if kind == "Unigram":
        return byte_level or bool(model.get("byte_fallback"))
    return False


def token_bound(tokenizer: Any) -> TokenBound | None:
    """The cheap bound for ``tokenizer``, or None when it cannot be trusted (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
    except (AttributeError, TypeError, ValueError):
        return None
    slack = _normalizer_slack(spec.get("normalizer"))
    if slack is None or not _keeps_every_character(spec):
        return None
    longest = max((len(piece) for piece in vocab), default=0)
    return TokenBound(longest, slack) if longest > 0 else None


def _plain_text_encoder(tokenizer: Any) -> Any:
    """A copy of the Rust tokenizer that encodes special-token text as text (None for a Python tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    plain = type(backend).from_str(backend.to_str())
    plain.encode_special_tokens = True
    plain.no_truncation()
    plain.no_padding()
    return plain


def _special_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (added tokens not marked special, which may be plain
    whitespace, are left alone, as in message content)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {str(t.content) for t in decoder.values() if getattr(t, "special", False) and hasattr(t, "content")}
    texts.update(str(t) for t in getattr(tokenizer, "all_special_tokens", None) or [])
    return tuple(sorted(t for t in texts if t))


def _special_kwarg_names(tokenizer: Any) -> frozenset[str]:
    """Template variables that transformers fills from the tokenizer (``bos_token``, ...): no kwarg may set them."""
    names = set(getattr(tokenizer, "special_tokens_map", None) or {})
    names.update(getattr(tokenizer, "SPECIAL_TOKENS_ATTRIBUTES", None) or [])
    return frozenset(names)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value (dict keys included)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the added tokens marked special: the ones ``split_special_tokens`` tokenizes as plain text."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(i for i, t in decoder.items() if getattr(t, "special", False))


# Sentinels stand for client strings in a second rendering; private-use characters stay as they are in JSON.
_SENTINEL_OPEN, _SENTINEL_CLOSE = "\ue000", "\ue001"


def _SENTINEL_RE(nonce: str) -> re.Pattern[str]:  # noqa: N802 - a pattern factory
    return re.compile(f"{_SENTINEL_OPEN}{nonce}\\.(\\d+){_SENTINEL_CLOSE}")


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it (``developer`` is ``system``; tool-call arguments as an object
    when they are one, as vLLM passes them)."""
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.reasoning_text() is not None:
        msg["reasoning_content"] = m.reasoning_text()
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                arguments: Any = json.loads(c.function.arguments)
            except (ValueError, RecursionError):  # nested past the parser's depth: kept as the client's text
                arguments = c.function.arguments
            if not isinstance(arguments, dict):
                arguments = c.function.arguments
            function = {"name": c.function.name, "arguments": arguments}
            calls.append({"id": c.id, "type": "function", "function": function})
        msg["tool_calls"] = calls
    return msg


def _mask_free(value: Any, sentinel: Any) -> Any:
    """Every string of a free-form JSON value (keys too) replaced by its sentinel."""
    if isinstance(value, str):
        return sentinel(value)
    if isinstance(value, list):
        return [_mask_free(v, sentinel) for v in value]
    if isinstance(value, dict):
        return {sentinel(k): _mask_free(v, sentinel) for k, v in value.items()}
    return value


# JSON-schema keywords, the only keys of a tool's parameters kept as they are (templates read them); every other
# key (a property or definition name, a key inside data, an unknown keyword) is client text, as is every string
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SCHEMA_KEYWORDS = frozenset(
    "type required items prefixItems additionalProperties propertyNames additionalItems unevaluatedProperties "
    "unevaluatedItems contains anyOf oneOf allOf not if then else $ref $schema $id $anchor $comment title "
    "description format pattern minimum maximum exclusiveMinimum exclusiveMaximum multipleOf minLength maxLength "
    "minItems maxItems uniqueItems minContains maxContains minProperties maxProperties nullable readOnly "
    "writeOnly deprecated contentMediaType contentEncoding".split()
)


def _mask_schema(value: Any, sentinel: Any) -> Any:
    """A JSON schema with every string replaced, keys too, except its keywords."""
    if isinstance(value, list):
        return [_mask_schema(v, sentinel) for v in value]
    if not isinstance(value, dict):
        return _mask_free(value, sentinel)
    out = {}
    for k, v in value.items():
        if k in _NAMED_SCHEMAS and isinstance(v, dict):
            out[k] = {sentinel(name): _mask_schema(sub, sentinel) for name, sub in v.items()}
        elif k in _SCHEMA_KEYWORDS:
            out[k] = _mask_schema(v, sentinel)
        else:
            out[k if k in SCHEMA_DATA_KEYWORDS else sentinel(k)] = _mask_free(v, sentinel)
    return out


def _mask_message(msg: dict[str, Any], sentinel: Any) -> dict[str, Any]:
    out = dict(msg, content=sentinel(msg["content"]))
    for key in ("name", "tool_call_id", "reasoning_content"):
        if key in msg:
            out[key] = sentinel(msg[key])
    if "tool_calls" in msg:
        out["tool_calls"] = [
            {**c, "id": sentinel(c["id"]), "function": {"name": sentinel(c["function"]["name"]),
                                                      "arguments": _mask_free(c["function"]["arguments"], sentinel)}}
            for c in msg["tool_calls"]
        ]
    return out


def _mask_tool(tool: dict[str, Any], sentinel: Any) -> dict[str, Any]:
    """A tool with every string replaced: its name, description and parameters (there keys too, but keywords)."""
    fn = {k: (_mask_schema if k == "parameters" else _mask_free)(v, sentinel) for k, v in tool["function"].items()}
    return {**tool, "function": fn}


def _splice(text: str, parts: list[str], values: list[str]) -> list[tuple[str, str]] | None:
    """``text`` as (template part, client string) pairs, each string as written or JSON-escaped; None when the
    rendering with sentinels does not line up with ``text`` (the template changed client text)."""
    out: list[tuple[str, str]] = []
    pos = 0
    for k, part in enumerate(parts):
        if not text.startswith(part, pos):
            return None
        pos += len(part)
        if k == len(values):
            out.append((part, ""))
            break
        nxt = parts[k + 1]
        value = values[k]
        for form in (value, json.dumps(value, ensure_ascii=False)[1:-1]):
            if text.startswith(form + nxt[:1], pos) or (not nxt and text.startswith(form, pos)):
                out.append((part, form))
                pos += len(form)
                break
        else:
            return None
    return out if pos == len(text) else None


def _no_chat_template() -> APIError:
    """The 400 of a chat request to a model without a chat template (``dflash_core.chat`` refuses to guess one)."""
    return APIError(400, "this model has no chat template; use /v1/completions", param="messages")


class PromptBuilder:
    """Turns requests into prompt token ids for one tokenizer (thread-safe; runs in a thread pool)."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        allow_special_tokens: bool = False,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.allow_special_tokens = allow_special_tokens
        self.chat_template = chat_template  # --chat-template: used instead of the tokenizer's (a request's wins)
        # a request's own template is client Jinja (unbounded run time, and its literal text holds special tokens
        # that no content check sees): refused unless the operator trusts the clients
        self.trust_request_chat_template = trust_request_chat_template
        self.bound = token_bound(tokenizer)
        self.special_ids = special_token_ids(tokenizer)
        self.vocab_size = len(tokenizer)
        self._plain = _plain_text_encoder(tokenizer) if self.special_ids else None
        self._token_texts = _special_token_texts(tokenizer)
        self._special_names = _special_kwarg_names(tokenizer)

    def check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """400 for kwargs that would put special tokens in the prompt: a special-token name, or its text."""
        if self.allow_special_tokens:
            return
        forged = sorted(set(kwargs) & self._special_names)
        if forged:
            raise APIError(
                400, f"chat_template_kwargs may not set {', '.join(forged)}", param="chat_template_kwargs"
            )
        for text in _strings(kwargs):
            token = next((t for t in self._token_texts if t in text), None)
            if token is not None:
                raise APIError(
                    400, f"chat_template_kwargs may not contain special-token text ({token!r})",
                    param="chat_template_kwargs",
                )

    # --- the cheap bound -----------------------------------------------------------------------------------

    def check_fits(self, text: str, requested: int | None, param: str) -> None:
        """400 ``context_length_exceeded`` for a text that cannot fit, without tokenizing it."""
        if self.bound is None or len(text) <= self.max_model_len:
            return  # short texts tokenize fast: the exact check follows
        check_min_prompt_tokens(self.bound.min_tokens(text), len(text), requested, self.max_model_len, param)

    # --- tokenization --------------------------------------------------------------------------------------

    def _ids(self, text: str, *, special: bool = True) -> list[int]:
        if special:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self._plain is not None:
            return list(self._plain.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def _render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        try:
            return render_chat(self.tokenizer, messages, **kwargs)
        except NoChatTemplateError:  # a ValueError: before the generic refusal below
            raise _no_chat_template() from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:  # e.g. roles that do not alternate
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        except Exception as e:  # noqa: BLE001 - any template failure ({{ 1/0 }}, ...) is the request's, never a 500
            raise APIError(
                400, f"the chat template failed: {type(e).__name__}: {e}", param="messages"
            ) from None

    def _template_kwargs(self, req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
        """What the template receives beside the messages: the client's kwargs (checked), then the request's
        fields (tools, generation prompt, template, thinking)."""
        kwargs = dict(req.chat_template_kwargs or {})
        bad = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs")
        self.check_template_kwargs(kwargs)
        kwargs.setdefault("add_generation_prompt", req.add_generation_prompt)
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        if req.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(
                400,
                "a request's chat_template is refused: the server runs it only when started with "
                "--trust-request-chat-template",
                param="chat_template",
            )
        template = req.chat_template if req.chat_template is not None else self.chat_template
        if template is not None:
            kwargs["chat_template"] = template
        if isinstance(req, ChatCompletionRequest) and req.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        return kwargs

    def chat(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        """Render the chat template and tokenize it; message text never becomes special tokens."""
        no_template = req.chat_template is None and self.chat_template is None
        if no_template and not has_chat_template(self.tokenizer):  # before the kwargs checks
            raise _no_chat_template()
        kwargs = self._template_kwargs(req)
        messages = [_message_dict(m) for m in req.messages or []]
        text = self._render(messages, kwargs)
        requested = req.requested_max_tokens() if isinstance(req, ChatCompletionRequest) else None
        self.check_fits(text, requested, "messages")
        ids = self._ids(text)
        if not self.allow_special_tokens and self.special_ids:
            ids = self._keep_content_as_text(messages, kwargs, text, ids)
        if isinstance(req, TokenizeRequest) and req.add_special_tokens:
            # as vLLM: the rendered text tokenized with add_special_tokens=True, i.e. the tokens the tokenizer's
            # post-processor adds around it (BOS, ...), with client text still plain text
            prefix, suffix = self._added_special_tokens()
            ids = [*prefix, *ids, *suffix]
        return ids

    def _added_special_tokens(self) -> tuple[list[int], list[int]]:
        """The ids ``add_special_tokens=True`` puts before and after a text (read off one probe text)."""
        probe = "a"
        bare = list(self.tokenizer(probe, add_special_tokens=False)["input_ids"])
        full = list(self.tokenizer(probe, add_special_tokens=True)["input_ids"])
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start], full[start + len(bare) :]
        return [], []  # a post-processor that changes the text's own tokens: nothing is added

    def _keep_content_as_text(
        self, messages: list[dict[str, Any]], kwargs: dict[str, Any], text: str, ids: list[int]
    ) -> list[int]:
        """``ids`` when client text added no special token; else the text re-tokenized with client text as text.

        Client text is every message string, tool-call names and arguments, and the tool definitions. A template
        may write a string as it is or as JSON (``tojson``), so each slot matches either form.
        """
        nonce = secrets.token_hex(8)
        strings: list[str] = []

        def sentinel(value: str) -> str:
            strings.append(value)
            return f"{_SENTINEL_OPEN}{nonce}.{len(strings) - 1}{_SENTINEL_CLOSE}"

        masked = [_mask_message(msg, sentinel) for msg in messages]
        masked_kwargs = dict(kwargs)
        if "tools" in kwargs:
            masked_kwargs["tools"] = [_mask_tool(t, sentinel) for t in kwargs["tools"]]
        try:
            masked_text = self._render(masked, masked_kwargs)
        except APIError:
            masked_text = None  # the template reads client text (a tool's schema): it cannot be masked
        found = [t for t in ids if t in self.special_ids]
        if masked_text is not None and found == [t for t in self._ids(masked_text) if t in self.special_ids]:
            return ids  # the template's own special tokens and no others
        pieces = [] if masked_text is None else _SENTINEL_RE(nonce).split(masked_text)
        spliced = _splice(text, pieces[0::2], [strings[int(i)] for i in pieces[1::2]]) if pieces else None
        if spliced is None:
            names = [self.tokenizer.convert_ids_to_tokens(t) for t in sorted(self.special_ids)]
            example = next((n for n in names if any(n in s for s in strings)), None)
            raise APIError(
                400,
                "message content contains special-token text"
                + (f" ({example!r})" if example else "")
                + " and this chat template changes message content, so it cannot be kept as plain text",
                param="messages",
            )
        out: list[int] = []
        for part, value in spliced:
            if part:
                out.extend(self._ids(part))
            if value:
                out.extend(self._ids(value, special=False))
        return out

    def tokenize_prompt(self, text: str, add_special_tokens: bool) -> list[int]:
        """A raw text's token ids (``/tokenize``; special-token text stays special, as in a completion prompt)."""
        self.check_fits(text, None, "prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def completions(self, req: CompletionRequest) -> list[list[int]]:
        """Tokenize each prompt of a completion request (special-token text stays special: a raw prompt)."""
        out = []
        for p in req.prompts():
            if isinstance(p, str):
                self.check_fits(p, req.max_tokens, "prompt")
                out.append(list(self.tokenizer(p)["input_ids"]))
            else:
                if any(t < 0 or t >= self.vocab_size for t in p):
                    raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
                out.append(list(p))
        return out
