"""Structured outputs: what a request asks for (`StructuredOutput`), the grammar engine that compiles it
(`GrammarBackend`, over llguidance), and one request's grammar state over its committed tokens (`GrammarState`).

The grammar constrains the target's choices: row i of a verify block is masked with the grammar state after the
committed output plus the first i draft tokens, so each row allows what plain decoding would allow at that position.
A draft token the grammar rejects could never be the target's choice, so the proposal ends there (`walk`), and the
grammar advances by committed tokens only (`advance`). A grammar ends by accepting a stop token (EOS or the
request's stop ids), and the request ends with it.

Tool calls as a grammar (`tool_call_structure`) live in `dflash_core/tool_grammar.py`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dflash_core import grammar_checks
from dflash_core.grammar_checks import GrammarFailure, TokenizerSource, check_schema, llguidance_errors, short_error

if TYPE_CHECKING:  # imported where used: the grammar helper process (server.grammar_compile) runs without torch
    import torch

KINDS = ("json_object", "json_schema", "regex", "ebnf", "lark")
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
        """The tokens the grammar allows next: bool [vocab_size] on the CPU; GrammarFailure when it fails."""

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
        self.backend, self.kind = backend, structured.kind
        self.spec = structured.spec  # the very spec compiled (identity: a replaced spec is compiled again)

    def is_for(self, backend: GrammarBackend, structured: StructuredOutput) -> bool:
        """Whether this is `structured` compiled by `backend`."""
        return self.backend is backend and self.kind == structured.kind and self.spec is structured.spec

    @abstractmethod
    def matcher(self, stop_ids: Sequence[int]) -> TokenMatcher:
        """A fresh matcher at the grammar's start that ends on any of `stop_ids` (a copy: cheap)."""

    def prepare(self, copies: int) -> None:
        """Make `copies` matchers' expensive part now (in a preparation thread), for `matcher` to take."""
        del copies  # by default nothing is worth making ahead


class GrammarBackend(ABC):
    """Compiles `StructuredOutput`s for one tokenizer and vocabulary.

    Compiling can take long (a big schema, the tokenizer's first read); a server compiles in its preparation
    threads (`precompile`), so that the engine's thread only copies (`matcher`). `compile` is thread-safe."""

    vocab_size: int

    @abstractmethod
    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """`structured` compiled (cached); ValueError naming the problem when it does not compile."""

    def precompile(self, structured: StructuredOutput, copies: int = 1) -> StructuredOutput:
        """`structured` carrying its compiled grammar with `copies` matchers made ahead (one per request that
        will use it), so that the engine's thread neither compiles nor copies."""
        compiled = self.compile(structured)
        compiled.prepare(copies)
        return dataclasses.replace(structured, compiled=compiled)

    def matcher(self, structured: StructuredOutput, stop_ids: Sequence[int]) -> TokenMatcher:
        """A fresh matcher for `structured` that ends on any of `stop_ids`: a copy of its precompiled grammar, else
        compiled here; ValueError when it does not compile."""
        compiled = structured.compiled
        if compiled is None or not compiled.is_for(self, structured):
            compiled = self.compile(structured)
        return compiled.matcher(stop_ids)


@dataclass
class _Template:
    """A cache entry: the compiled LLMatcher at the grammar's start, its first mask, its memory (an estimate)."""

    matcher: Any
    first: torch.Tensor  # bool [vocab_size]: what the grammar allows first (llguidance's EOS included)
    nbytes: int


class _LLGuidanceCompiled(CompiledGrammar):
    """A compiled LLMatcher at the grammar's start (copied per request; copies made ahead by `prepare`)."""

    def __init__(self, backend: LLGuidanceBackend, structured: StructuredOutput, template: _Template) -> None:
        super().__init__(backend, structured)
        self._llg, self.template = backend, template
        self._spares: list[Any] = []  # copies made in a preparation thread (list.pop is atomic)

    def _copy(self) -> Any:
        with llguidance_errors(f"{self.kind} matcher", RuntimeError):
            return self.template.matcher.deep_copy()

    def prepare(self, copies: int) -> None:
        self._spares.extend(self._copy() for _ in range(max(0, copies - len(self._spares))))

    def matcher(self, stop_ids: Sequence[int]) -> TokenMatcher:
        try:
            m = self._spares.pop()
        except IndexError:
            m = self._copy()
        return _LLGuidanceMatcher(m, self._llg.ll_tokenizer, stop_ids, self._llg.vocab_size, self.template.first,
                                  lambda: self._llg.forget(self.template))


class LLGuidanceBackend(GrammarBackend):
    """llguidance over a Hugging Face (fast) tokenizer. `vocab_size` is the model's (lm_head) vocabulary: ids
    beyond the tokenizer's are never allowed. The tokenizer's vocabulary is read on the first structured request
    (a fraction of a second, up to a second or so for a large vocabulary, which requests without a grammar never
    pay); compiled grammars are cached, at most `cache_entries` of them and `cache_bytes` of memory together (each
    measured as the process's memory growth while it compiled: an estimate, on the high side when other threads
    allocate meanwhile), and each request gets a copy. A compile computes the grammar's first mask too, so that
    a grammar that allows nothing is an error here and no request computes that mask on the engine's thread.
    Thread-safe: the cache and the tokenizer read are locked; two threads compiling the same spec at once both
    compile it (one is kept)."""

    CACHE = 64  # compiled grammars kept (least recently used dropped)
    CACHE_BYTES = 512 * 1024 * 1024  # and their memory together (one anyOf-heavy schema can take 30-50 MB)

    def __init__(
        self, tokenizer: Any, vocab_size: int, cache_entries: int = CACHE, cache_bytes: int = CACHE_BYTES
    ) -> None:
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.cache_entries, self.cache_bytes = cache_entries, cache_bytes
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[tuple[str, str], _Template] = OrderedDict()
        self._lock, self._tokenizer_lock = threading.Lock(), threading.Lock()

    def tokenizer_source(self) -> TokenizerSource:
        """What this backend's llguidance tokenizer is built from (for a grammar helper process)."""
        try:
            return TokenizerSource.of(self.tokenizer, self.vocab_size)
        except Exception as exc:  # a request error (400), not a server failure
            raise ValueError(f"structured output is unavailable for this tokenizer: {exc}") from None

    @property
    def ll_tokenizer(self) -> Any:
        """llguidance's LLTokenizer for this tokenizer (built once), at least `vocab_size` ids wide."""
        if self._ll_tokenizer is None:
            with self._tokenizer_lock:
                if self._ll_tokenizer is None:
                    source = self.tokenizer_source()
                    try:
                        with llguidance_errors("the tokenizer's read"):
                            self._ll_tokenizer = source.build()
                    except Exception as exc:
                        raise ValueError(f"structured output is unavailable for this tokenizer: {exc}") from None
        return self._ll_tokenizer

    @property
    def cached_bytes(self) -> int:
        """The memory of the cached grammars (their estimates, together)."""
        with self._lock:
            return sum(t.nbytes for t in self._compiled.values())

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        key = _cache_key(structured)
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
        if cached is None:
            cached = self._build(structured)
            self._keep(key, cached)
        return _LLGuidanceCompiled(self, structured, cached)

    def _build(self, structured: StructuredOutput) -> _Template:
        """`structured` compiled, with its first mask (ValueError naming the problem)."""
        from llguidance import LLMatcher

        grammar = _llguidance_grammar(structured)
        ll_tokenizer = self.ll_tokenizer
        before = grammar_checks.rss_bytes()
        with llguidance_errors(f"{structured.kind} does not compile"):
            template = LLMatcher(ll_tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"{structured.kind} does not compile: {short_error(template.get_error())}")
            first = _first_mask(template, ll_tokenizer, self.vocab_size, structured.kind)
        # the text, the compiled rules and the lexer states: never less than a few times the grammar's text
        nbytes = max(grammar_checks.rss_bytes() - before, 4 * len(grammar))
        return _Template(template, first, nbytes)

    def forget(self, template: _Template) -> None:
        """Drop `template` from the cache: a matcher of it failed mid-output, and a limit hit there breaks the
        lexer state every copy shares (a fresh compile starts clean)."""
        with self._lock:
            for key in [k for k, t in self._compiled.items() if t is template]:
                del self._compiled[key]

    def _keep(self, key: tuple[str, str], template: _Template) -> None:
        """Cache `template`, dropping the least recently used beyond the entry and byte bounds."""
        if template.nbytes > self.cache_bytes:
            return  # alone over the bound: compiled for this request only
        with self._lock:
            self._compiled[key] = template
            total = sum(t.nbytes for t in self._compiled.values())
            while len(self._compiled) > self.cache_entries or total > self.cache_bytes:
                _, dropped = self._compiled.popitem(last=False)
                total -= dropped.nbytes


def _cache_key(structured: StructuredOutput) -> tuple[str, str]:
    spec = structured.spec
    return structured.kind, spec if isinstance(spec, str) else json.dumps(spec)


def _first_mask(template: Any, ll_tokenizer: Any, vocab_size: int, kind: str) -> torch.Tensor:
    """What `template` allows first, as bool [vocab_size] (ValueError when the grammar allows nothing)."""
    import torch

    bitmask = torch.full(((ll_tokenizer.vocab_size + 31) // 32,), -1, dtype=torch.int32)
    template.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
    if template.is_error():
        raise ValueError(f"{kind} does not compile: {short_error(template.get_error())}")
    return _unpack(bitmask, vocab_size)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask as bool [vocab_size] (bit j of word w is token 32 w + j)."""
    import torch

    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()


def _llguidance_grammar(structured: StructuredOutput) -> str:
    """llguidance's grammar text for `structured` (checked when the matcher is built); ValueError for what cannot
    even be translated (a panic too)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    with llguidance_errors(f"{structured.kind} does not compile"):
        try:
            if structured.kind == "json_object":  # any object (not any value), as vLLM compiles it
                return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            if structured.kind == "json_schema":
                spec = structured.spec
                if spec is False:
                    raise ValueError("the schema false allows no value")
                check_schema(spec)  # before llguidance reads it: some schemas crash it
                return LLMatcher.grammar_from_json_schema({} if spec is True else spec, overrides=JSON_OPTIONS)
            if structured.kind == "regex":
                return LLMatcher.grammar_from_regex(str(structured.spec))
            text = str(structured.spec)
            return LLMatcher.grammar_from_lark(any_to_lark(text) if structured.kind == "ebnf" else text)
        except Exception as exc:  # a bad schema / GBNF raises while translating, the rest when the matcher is built
            raise ValueError(f"{structured.kind} does not compile: {short_error(str(exc))}") from None


def pack_masks(masks: Sequence[torch.Tensor | None], vocab_size: int) -> torch.Tensor:
    """Rows of allowed tokens (bool [vocab_size]; None: every token) as llguidance's / xgrammar's int32 bitmask
    (bit j of word w is token 32 w + j), an even number of words per row so that the rows also read as int64
    words (bit j of word w is token 64 w + j, little-endian) -> int32 [len(masks), 2 * ceil(vocab_size / 64)]."""
    import torch

    words64 = (vocab_size + 63) // 64
    bits = torch.ones(len(masks), words64 * 64, dtype=torch.bool)
    for i, allowed in enumerate(masks):
        if allowed is not None:
            bits[i, :vocab_size] = allowed[:vocab_size]
    weights = torch.ones(8, dtype=torch.int32) << torch.arange(8, dtype=torch.int32)
    packed = (bits.view(len(masks), -1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)  # little bit order
    return packed.view(torch.int32)


def unpack_masks(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`pack_masks`' rows read as int64 words ([n, ceil(vocab_size / 64)], any device) -> bool [n, vocab_size], by
    shift and and, on the words' device."""
    import torch

    shifts = torch.arange(64, device=words.device, dtype=torch.int64)
    bits = (words[:, :, None] >> shifts) & 1  # arithmetic shift: bit 63 still reads as its own bit
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


class _LLGuidanceMatcher(TokenMatcher):
    """llguidance's LLMatcher, with the request's stop ids as the grammar's end: llguidance's own end token (the
    tokenizer's EOS) only tells that the grammar is accepting; a stop id is allowed exactly then, and accepting
    one terminates the matcher here (llguidance never sees it, so a rollback over it is ours). At the grammar's
    start the mask is `first`, computed once when the grammar compiled (the engine's thread computes masks only
    after a committed token). llguidance failing mid-output (no token left, a lexer limit) is a `GrammarFailure`,
    after `on_error` (the cached template dropped)."""

    def __init__(
        self, m: Any, ll_tokenizer: Any, stop_ids: Sequence[int], vocab_size: int, first: torch.Tensor | None = None,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        import torch

        self.m, self.on_error = m, on_error
        self.vocab_size, self.first = vocab_size, first
        self.depth = 0  # tokens llguidance has consumed (0: at the start, where `first` holds)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.stop = torch.tensor(sorted(t for t in self.stop_ids if 0 <= t < vocab_size), dtype=torch.long)
        self.ll_eos_ids = frozenset(int(t) for t in ll_tokenizer.eos_tokens) - self.stop_ids
        self.ll_eos = torch.tensor(sorted(t for t in self.ll_eos_ids if t < vocab_size), dtype=torch.long)
        # one bit per id of llguidance's vocabulary, filled in place (what llguidance.torch.fill_next_token_bitmask
        # does; importing that module costs seconds of torch.compile set-up)
        self.bitmask = torch.full(((ll_tokenizer.vocab_size + 31) // 32,), -1, dtype=torch.int32)
        self.terminated = False

    def allowed(self) -> torch.Tensor:
        import torch

        if self.terminated:
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        if self.depth == 0 and self.first is not None:
            allowed = self.first.clone()
        else:
            with llguidance_errors("grammar matcher failed", RuntimeError):
                self.m.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)  # int32 words
            if self.m.is_error():  # no token left, a resource limit: fail this request, not the batch
                raise self._failure()
            allowed = _unpack(self.bitmask, self.vocab_size)
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
        with llguidance_errors("grammar matcher failed", RuntimeError):
            ok = self.m.try_consume_tokens([token]) == 1  # unlike consume_token, a rejection leaves no error state
        if not ok and self.m.is_error():  # not a rejection: a limit hit (the mask allowed the token)
            raise self._failure()
        self.depth += ok
        return ok

    def _failure(self) -> GrammarFailure:
        """llguidance's error state as the request's failure (its template dropped: see `forget`)."""
        if self.on_error is not None:
            self.on_error()
        dead_end = f"the grammar allows no token after {self.depth} token(s) of structured output"
        message = short_error(self.m.get_error(), no_extension=dead_end)
        return GrammarFailure(message if message == dead_end else f"{dead_end}: llguidance hit a limit: {message}")

    def rollback(self, n: int) -> None:
        if n and self.terminated:
            self.terminated, n = False, n - 1
        if n and not self.m.rollback(n):
            raise RuntimeError(f"grammar matcher cannot roll back {n} tokens: {short_error(self.m.get_error())}")
        self.depth -= n

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
        self.count = 0  # tokens the grammar has taken

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
        """How many leading draft tokens the grammar allows (the proposal ends at the first it rejects, after one
        that ends the grammar, and before one after which it allows nothing: the next step fails if the target
        chooses it, as plain decoding would). Remembers each row's mask for `masks`; the state is unchanged.
        `GrammarFailure` when nothing is allowed after the committed output, or the matcher fails (for good)."""
        first = self._first_constrained(draft)
        masks: list[torch.Tensor | None] = [None] * min(first, len(draft) + 1)
        keep, accepted = len(draft), 0
        for i in range(first, len(draft) + 1):
            allowed = self.matcher.allowed()
            if not allowed.any():  # never sample from nothing
                if i == 0:
                    raise GrammarFailure(f"the grammar allows no token after {self.count} token(s) of structured "
                                         "output")
                keep = i - 1
                break
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
            if not self.matcher.accept(tok):  # (a matcher that fails raises GrammarFailure)
                raise RuntimeError(f"token {tok} was committed but the grammar rejects it")
            self.count += 1
            if self.matcher.is_terminated():
                return j + 1
        return None

    def is_terminated(self) -> bool:
        return self.started and self.matcher.is_terminated()
