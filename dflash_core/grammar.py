"""Structured outputs: what a request asks for (`StructuredOutput`), the grammar engine that compiles it
(`GrammarBackend`, over llguidance), and one request's grammar state over its committed tokens (`GrammarState`).

The grammar constrains the target's choices: row i of a verify block is masked with the grammar state after the
committed output plus the first i draft tokens, so each row allows what plain decoding would allow at that position.
A draft token the grammar rejects could never be the target's choice, so the proposal ends there (`walk`), and the
grammar advances by committed tokens only (`advance`). A grammar ends by accepting a stop token (EOS or the
request's stop ids), and the request ends with it.

The tool-call builders (`tool_call_structure`) express "one or more calls of these tools, each with arguments
matching its schema" in the two text styles the tool-call parsers read (hermes, llama3_json) as a Lark grammar.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

KINDS = ("json_object", "json_schema", "regex", "ebnf", "lark")
TOOL_STYLES = ("hermes", "llama3_json")
# How each style writes one call, and what separates parallel calls (what the matching tool-call parser reads).
_TOOL_TAGS = {
    "hermes": ("<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
    "llama3_json": ("", "", "; ", "parameters"),
}
# JSON as json.dumps writes it (", " and ": ", no other whitespace): unbounded whitespace lets a model loop on spaces.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class StructuredOutput:
    """A request's output constraint.

    kind: json_object (any JSON object), json_schema (`spec` a JSON schema dict), regex (`spec` a pattern), ebnf
    (`spec` a GBNF / EBNF grammar, root rule `root`), lark (`spec` a grammar in llguidance's Lark syntax, root rule
    `start`). `strict` is OpenAI's json_schema flag; the grammar enforces the schema exactly either way (as vLLM
    does), and a schema keyword the engine does not implement is refused. `start_after`: token ids (a reasoning
    end marker such as `</think>`); the grammar applies only once the output contains them; None: from the first
    token.
    """

    kind: str
    spec: dict[str, Any] | str | None = None
    strict: bool = False
    start_after: list[int] | None = None
    # the grammar compiled ahead (`GrammarBackend.precompile`, off the engine's thread): the engine only copies it
    compiled: CompiledGrammar | None = field(default=None, compare=False, repr=False)

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        if self.kind not in KINDS:
            raise ValueError(f"structured.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json_object" and self.spec is not None:
            raise ValueError("structured.spec must be None for json_object")
        if self.kind == "json_schema" and not isinstance(self.spec, (dict, bool)):
            raise ValueError("structured.spec must be a JSON schema (a dict) for json_schema")
        if self.kind in ("regex", "ebnf", "lark") and (not isinstance(self.spec, str) or not self.spec):
            raise ValueError(f"structured.spec must be a non-empty string for {self.kind}")
        if self.start_after is not None and (
                not isinstance(self.start_after, (list, tuple)) or not self.start_after
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.start_after)):
            raise ValueError("structured.start_after must be None or a non-empty list of token ids")


# ---- the grammar engine ----
class TokenMatcher(ABC):
    """One compiled grammar's matching state over token ids (a backend's matcher)."""

    @abstractmethod
    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: bool [vocab_size] on the CPU."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by one token; False (and no change) when the grammar rejects it."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""


class CompiledGrammar(ABC):
    """One `StructuredOutput` compiled by a backend: shared and never advanced; each request matches a copy."""

    def __init__(self, backend: GrammarBackend, structured: StructuredOutput) -> None:
        self.backend = backend
        self.kind = structured.kind
        self.spec = structured.spec  # the very spec compiled (identity: a replaced spec is compiled again)

    def is_for(self, backend: GrammarBackend, structured: StructuredOutput) -> bool:
        """Whether this is `structured` compiled by `backend`."""
        return self.backend is backend and self.kind == structured.kind and self.spec is structured.spec

    @abstractmethod
    def matcher(self, stop_ids: Sequence[int]) -> TokenMatcher:
        """A fresh matcher at the grammar's start that ends on any of `stop_ids` (a copy: cheap)."""


class GrammarBackend(ABC):
    """Compiles `StructuredOutput`s for one tokenizer and vocabulary.

    Compiling can take long (a big schema, the tokenizer's first read); a server compiles in its preparation
    threads (`precompile`), so that the engine's thread only copies (`matcher`). `compile` is thread-safe."""

    vocab_size: int

    @abstractmethod
    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """`structured` compiled (cached); ValueError naming the problem when it does not compile."""

    def precompile(self, structured: StructuredOutput) -> StructuredOutput:
        """`structured` carrying its compiled grammar (for the engine to copy)."""
        return dataclasses.replace(structured, compiled=self.compile(structured))

    def matcher(self, structured: StructuredOutput, stop_ids: Sequence[int]) -> TokenMatcher:
        """A fresh matcher for `structured` that ends on any of `stop_ids`: a copy of its precompiled grammar, else
        compiled here; ValueError when it does not compile."""
        compiled = structured.compiled
        if compiled is None or not compiled.is_for(self, structured):
            compiled = self.compile(structured)
        return compiled.matcher(stop_ids)


@contextmanager
def _llguidance_errors(what: str, error: type[Exception] = ValueError) -> Iterator[None]:
    """llguidance's failures as `error`, panics included: a Rust panic reaches Python as pyo3's PanicException, a
    BaseException that would otherwise end the thread (the engine's worker) instead of the request."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except ValueError:
        raise
    except BaseException as exc:  # noqa: BLE001 - see above: PanicException is not an Exception
        raise error(f"{what}: {type(exc).__name__}: {exc}") from None


class _LLGuidanceCompiled(CompiledGrammar):
    """A compiled LLMatcher at the grammar's start (copied per request)."""

    def __init__(self, backend: LLGuidanceBackend, structured: StructuredOutput, template: Any) -> None:
        super().__init__(backend, structured)
        self._llg = backend
        self.template = template

    def matcher(self, stop_ids: Sequence[int]) -> TokenMatcher:
        with _llguidance_errors(f"{self.kind} matcher", RuntimeError):
            m = self.template.deep_copy()
        return _LLGuidanceMatcher(m, self._llg.ll_tokenizer, stop_ids, self._llg.vocab_size)


class LLGuidanceBackend(GrammarBackend):
    """llguidance over a Hugging Face (fast) tokenizer. `vocab_size` is the model's (lm_head) vocabulary: ids
    beyond the tokenizer's are never allowed. The tokenizer's vocabulary is read on the first structured request
    (a fraction of a second, up to a second or so for a large vocabulary, which requests without a grammar never
    pay); compiled grammars are cached and each request gets a copy. Thread-safe: the cache and the tokenizer
    read are locked; two threads compiling the same spec at once both compile it (one is kept)."""

    CACHE = 64  # compiled grammars kept (least recently used dropped)

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[tuple[str, str], _LLGuidanceCompiled] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> Any:
        """llguidance's LLTokenizer for this tokenizer (built once), at least `vocab_size` ids wide."""
        if self._ll_tokenizer is None:
            with self._tokenizer_lock:
                if self._ll_tokenizer is None:
                    try:
                        with _llguidance_errors("the tokenizer's read"):
                            import llguidance.hf

                            n_vocab = max(self.vocab_size, len(self.tokenizer))
                            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab)
                    except Exception as exc:  # a request error (400), not a server failure
                        raise ValueError(f"structured output is unavailable for this tokenizer: {exc}") from None
        return self._ll_tokenizer

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        from llguidance import LLMatcher

        key = (structured.kind, structured.spec if isinstance(structured.spec, str) else json.dumps(structured.spec))
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
        if cached is not None:
            return _LLGuidanceCompiled(self, structured, cached.template)
        grammar = _llguidance_grammar(structured)
        ll_tokenizer = self.ll_tokenizer
        with _llguidance_errors(f"{structured.kind} does not compile"):
            template = LLMatcher(ll_tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"{structured.kind} does not compile: {template.get_error()}")
        compiled = _LLGuidanceCompiled(self, structured, template)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > self.CACHE:
                self._compiled.popitem(last=False)
        return compiled


def _llguidance_grammar(structured: StructuredOutput) -> str:
    """llguidance's grammar text for `structured` (checked when the matcher is built); ValueError for what cannot
    even be translated."""
    with _llguidance_errors(f"{structured.kind} does not compile"):  # a panic too
        return _translate(structured)


def _translate(structured: StructuredOutput) -> str:
    """`_llguidance_grammar` without the panic guard."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        if structured.kind == "json_object":  # any object (not any value), as vLLM compiles it
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if structured.kind == "json_schema":
            spec = structured.spec
            if spec is False:
                raise ValueError("the schema false allows no value")
            return LLMatcher.grammar_from_json_schema({} if spec is True else spec, overrides=JSON_OPTIONS)
        if structured.kind == "regex":
            return LLMatcher.grammar_from_regex(str(structured.spec))
        text = str(structured.spec)
        return LLMatcher.grammar_from_lark(any_to_lark(text) if structured.kind == "ebnf" else text)
    except Exception as exc:  # a bad schema / GBNF raises while translating, the rest when the matcher is built
        raise ValueError(f"{structured.kind} does not compile: {exc}") from None


class _LLGuidanceMatcher(TokenMatcher):
    """llguidance's LLMatcher, with the request's stop ids as the grammar's end: llguidance's own end token (the
    tokenizer's EOS) only tells that the grammar is accepting; a stop id is allowed exactly then, and accepting
    one terminates the matcher here (llguidance never sees it, so a rollback over it is ours)."""

    def __init__(self, m: Any, ll_tokenizer: Any, stop_ids: Sequence[int], vocab_size: int) -> None:
        self.m = m
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.stop = torch.tensor(sorted(t for t in self.stop_ids if 0 <= t < vocab_size), dtype=torch.long)
        self.ll_eos_ids = frozenset(int(t) for t in ll_tokenizer.eos_tokens) - self.stop_ids
        self.ll_eos = torch.tensor(sorted(t for t in self.ll_eos_ids if t < vocab_size), dtype=torch.long)
        # one bit per id of llguidance's vocabulary, filled in place (what llguidance.torch.fill_next_token_bitmask
        # does; importing that module costs seconds of torch.compile set-up)
        self.bitmask = torch.full(((ll_tokenizer.vocab_size + 31) // 32,), -1, dtype=torch.int32)
        self.shifts = torch.arange(32, dtype=torch.int32)
        self.terminated = False

    def allowed(self) -> torch.Tensor:
        if self.terminated:
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        with _llguidance_errors("grammar matcher failed", RuntimeError):
            self.m.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * self.bitmask.element_size())
        if self.m.is_error():  # a resource limit mid-output: fail this request, not the batch
            raise RuntimeError(f"grammar matcher failed: {self.m.get_error()}")
        bits = (self.bitmask[:, None] >> self.shifts) & 1  # bit j of word w is token 32 w + j
        allowed = bits.reshape(-1)[: self.vocab_size].bool()
        allowed[self.ll_eos] = False
        allowed[self.stop] = self.m.is_accepting()
        return allowed

    def accept(self, token: int) -> bool:
        token = int(token)
        if self.terminated or not 0 <= token < self.vocab_size:
            return False
        if token in self.stop_ids:
            self.terminated = self.m.is_accepting()
            return self.terminated
        if token in self.ll_eos_ids:  # not this request's stop: never allowed (see allowed)
            return False
        with _llguidance_errors("grammar matcher failed", RuntimeError):
            return self.m.try_consume_tokens([token]) == 1  # unlike consume_token, a rejection leaves no error state

    def rollback(self, n: int) -> None:
        if n and self.terminated:
            self.terminated, n = False, n - 1
        if n and not self.m.rollback(n):
            raise RuntimeError(f"grammar matcher cannot roll back {n} tokens: {self.m.get_error()}")

    def is_terminated(self) -> bool:
        return self.terminated


class GrammarState:
    """One request's grammar over its committed output, with the optional start marker (`start_after`)."""

    def __init__(self, matcher: TokenMatcher, start_after: Sequence[int] | None = None) -> None:
        self.matcher = matcher
        self.marker = tuple(start_after or ())
        self.started = not self.marker
        self._recent: list[int] = []  # the output's last len(marker) - 1 tokens while the marker is awaited
        self._walked: tuple[tuple[int, ...], list[torch.Tensor | None]] | None = None

    def _first_constrained(self, draft: Sequence[int]) -> int:
        """The first row (row i follows draft[:i]) that the grammar constrains; len(draft) + 1: none."""
        if self.started:
            return 0
        seq, m = self._recent + list(draft), len(self.marker)
        for end in range(m, len(seq) + 1):
            if tuple(seq[end - m:end]) == self.marker:
                return end - len(self._recent)
        return len(draft) + 1

    def walk(self, draft: Sequence[int]) -> int:
        """How many leading draft tokens the grammar allows (the proposal ends at the first it rejects, and after
        one that ends the grammar). Remembers each row's mask for `masks`; the state is unchanged."""
        first = self._first_constrained(draft)
        masks: list[torch.Tensor | None] = [None] * min(first, len(draft) + 1)
        keep, accepted = len(draft), 0
        for i in range(first, len(draft) + 1):
            allowed = self.matcher.allowed()
            masks.append(allowed)
            if i == len(draft):
                break
            if not (bool(allowed[draft[i]]) and self.matcher.accept(draft[i])):
                keep = i
                break
            accepted += 1
            if self.matcher.is_terminated():  # a stop token: the rows after it are never committed
                keep = i + 1
                masks.append(None)
                break
        self.matcher.rollback(accepted)
        self._walked = (tuple(draft[:keep]), masks[: keep + 1])
        return keep

    def masks(self, draft: Sequence[int]) -> list[torch.Tensor | None]:
        """Row i's allowed tokens (None: unconstrained) for rows 0..len(draft), every draft token allowed."""
        if self._walked is None or self._walked[0] != tuple(draft):
            if self.walk(draft) != len(draft):
                raise ValueError("the draft holds a token the grammar rejects; cut it with walk() first")
        assert self._walked is not None
        return self._walked[1]

    def advance(self, tokens: Sequence[int]) -> int | None:
        """Accept committed tokens; the count kept when the grammar ended inside them (drop the rest), else None."""
        self._walked = None
        for j, tok in enumerate(tokens):
            if not self.started:
                self._recent.append(int(tok))
                if tuple(self._recent[-len(self.marker):]) == self.marker:
                    self.started, self._recent = True, []
                else:
                    self._recent = self._recent[max(0, len(self._recent) - len(self.marker) + 1):]
                continue
            if not self.matcher.accept(tok):
                raise RuntimeError(f"token {tok} was committed but the grammar rejects it")
            if self.matcher.is_terminated():
                return j + 1
        return None

    def is_terminated(self) -> bool:
        return self.started and self.matcher.is_terminated()


# ---- tool calls as a grammar ----
def tool_call_structure(
    tools: Sequence[dict[str, Any]],
    style: Literal["hermes", "llama3_json"],
    named: str | None = None,
    parallel: bool = True,
) -> StructuredOutput:
    """A Lark `StructuredOutput` for tool calls: one call (or, with `parallel`, one or more) of `tools` (OpenAI
    `{"type": "function", "function": {...}}` entries), or of the tool `named` only, each call's arguments matching
    that tool's `parameters` JSON schema; ValueError naming a tool whose parameters do not compile.

    hermes writes `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, parallel calls joined by "\\n";
    llama3_json writes `{"name": N, "parameters": {...}}`, parallel calls joined by "; ".
    """
    from llguidance import LLMatcher

    if style not in _TOOL_TAGS:
        raise ValueError(f"tool-call style must be one of {', '.join(TOOL_STYLES)}, got {style!r}")
    begin, end, separator, args_key = _TOOL_TAGS[style]
    functions = [tool.get("function", tool) for tool in tools]
    if named is not None:
        functions = [f for f in functions if f.get("name") == named]
        if not functions:
            raise ValueError(f"tool_choice names {named!r}, which is not among the tools")
    if not functions:
        raise ValueError("tools must hold at least one function")
    rules = []
    for i, fn in enumerate(functions):
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        # each call is its own schema document: the parameters' definitions move to its root, where their
        # "#/$defs/..." references point; every other root-relative reference ("#", "#/properties/...") is
        # rebased onto where the parameters now sit
        params.pop("$id", None)  # the parameters are no longer a document of their own
        params = _rebase_refs(params, f"#/properties/{args_key}", fn["name"])
        defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
        schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                  "required": ["name", args_key], "additionalProperties": False, **defs, "x-guidance": JSON_OPTIONS}
        with _llguidance_errors(f"tool {fn['name']!r}: parameters do not compile"):
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
        if error:
            raise ValueError(f"tool {fn['name']!r}: parameters do not compile: {error}")
        rules.append(f"call_{i}: %json {json.dumps(schema)}")
    # the calls' JSON share one lexeme class, so the parser keeps every tool open until "name" decides
    call = " ".join([*([json.dumps(begin)] if begin else []), "body", *([json.dumps(end)] if end else [])])
    start = f"start: call ({json.dumps(separator)} call)*" if parallel else "start: call"
    body = "body: " + " | ".join(f"call_{i}" for i in range(len(functions)))
    return StructuredOutput("lark", "\n".join([start, f"call: {call}", body, *rules]) + "\n")


_DEF_KEYS = ("$defs", "definitions")
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values there are data, not schemas


def _rebase_refs(schema: Any, base: str, tool: str) -> Any:
    """`schema` with its root-relative `$ref`s pointing under `base` (a JSON pointer fragment), except those into
    its own `$defs` / `definitions`, which move to the new root with it; ValueError for a nested `$id` (the
    references under it are relative to another document, which the rewrite cannot follow)."""

    def rebase(ref: str) -> str:
        if ref != "#" and not ref.startswith("#/"):
            return ref  # a remote reference or an anchor: not root-relative
        path = ref[1:]
        if any(path == f"/{k}" or path.startswith(f"/{k}/") for k in _DEF_KEYS):
            return ref
        return base + path

    def walk(value: Any, root: bool) -> Any:
        if isinstance(value, list):
            return [walk(v, False) for v in value]
        if not isinstance(value, dict):
            return value
        if not root and isinstance(value.get("$id"), str):
            raise ValueError(f"tool {tool!r}: parameters with a nested $id are not supported")
        out: dict[str, Any] = {}
        for k, v in value.items():
            if k == "$ref" and isinstance(v, str):
                out[k] = rebase(v)
            elif k == "properties" and isinstance(v, dict):  # property names are names, their values schemas
                out[k] = {name: walk(sub, False) for name, sub in v.items()}
            elif k in _DATA_KEYWORDS:
                out[k] = v
            else:
                out[k] = walk(v, False)
        return out

    return walk(schema, True)
