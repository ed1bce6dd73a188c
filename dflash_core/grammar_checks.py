"""Checks that keep a client's grammar from hurting the process that compiles it (torch-free, so that a grammar
helper process starts fast).

- `check_schema`: what llguidance cannot take safely or would only fail on mid-output, found by reading the JSON
  schema: non-finite numbers (NaN, Infinity: not JSON, and llguidance writes NaN as null), integer bounds outside
  int64 (llguidance crashes, SIGSEGV, near -2^63 and silently clamps beyond), and schemas that no finite value
  satisfies (`{"$ref": "#"}`, a `$defs` cycle, a required self-reference).
- `probe`: a compiled grammar's first tokens tried, so that a resource limit llguidance hits at once (an object with
  thousands of optional properties: "max is 2000" items in a row) is an error before any token is generated.
- `TokenizerSource`: what llguidance's tokenizer is built from, sendable to another process.
- `GrammarFailure`, `llguidance_errors`, `short_error`: llguidance's failures as short, client-readable errors.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from copy import copy
from dataclasses import dataclass
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PROBE_TOKENS = 48  # tokens a probe walks (forced ones first, else the lowest allowed id)
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_NEVER = "never"  # a requirement nothing satisfies (a `false` schema)


class GrammarFailure(ValueError):
    """A request's grammar cannot go on mid-output (it allows no token, or llguidance hit a limit): the client's
    grammar is at fault, not the server; the request fails alone."""


@contextmanager
def llguidance_errors(what: str, error: type[Exception] = ValueError) -> Iterator[None]:
    """llguidance's failures as `error` (`short_error`'s message), panics included: a Rust panic reaches Python as
    pyo3's PanicException, a BaseException that would otherwise end the thread (the engine's worker) instead of
    the request."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except ValueError:
        raise
    except BaseException as exc:  # noqa: BLE001 - see above: PanicException is not an Exception
        raise error(f"{what}: {type(exc).__name__}: {short_error(str(exc))}") from None


# ---- the schema read ----
def check_schema(schema: Any) -> None:
    """ValueError naming what llguidance cannot take in `schema` (a JSON schema)."""
    _check_finite(schema)
    if not isinstance(schema, dict):
        return
    nodes = list(_subschemas(schema))
    for path, node in nodes:
        _check_bounds(path, node)
    if not _productive(schema, [node for _, node in nodes]):
        raise ValueError(
            "the schema allows no finite value: it refers back to itself with no way out (a $ref to an "
            "enclosing schema or a $defs cycle, directly or through required properties)"
        )


def _subschemas(root: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in `root` with its JSON pointer (iterative: deep nesting needs no recursion)."""
    stack: list[tuple[str, Any]] = [("#", root)]
    seen: set[int] = set()
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield path, node
        for key in _SCHEMA_ONE:
            stack.append((f"{path}/{key}", node.get(key)))
        for key in _SCHEMA_LIST:
            if isinstance(node.get(key), list):
                stack.extend((f"{path}/{key}/{i}", sub) for i, sub in enumerate(node[key]))
        for key in _SCHEMA_MAP:
            if isinstance(node.get(key), dict):
                stack.extend((f"{path}/{key}/{_escape(name)}", sub) for name, sub in node[key].items())


def _check_finite(schema: Any) -> None:
    """Every number in `schema` (a const, an enum member, a bound, a default...) must be finite: JSON has no NaN
    or Infinity (Python's json reads them, and 1e999 as Infinity), and llguidance would write NaN as null."""
    stack: list[tuple[str, Any]] = [("#", schema)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{path}: {json.dumps(value)} is not a JSON number (a schema may hold only finite "
                             "numbers; Infinity is also what a number too large for a double reads as)")
        if isinstance(value, dict):
            stack.extend((f"{path}/{_escape(k)}", v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}/{i}", v) for i, v in enumerate(value))


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _check_bounds(path: str, node: dict[str, Any]) -> None:
    """Integer bounds must be int64 values: llguidance's integer ranges are int64 (beyond, it crashes or clamps)."""
    types = node.get("type")
    if not (types == "integer" or (isinstance(types, list) and "integer" in types)):
        return
    for key in _BOUNDS:
        value = node.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(
                f"{path}: integer {key} {value!r} is outside the 64-bit integer range [-2^63, 2^63 - 1]"
            )


def _resolve(root: dict[str, Any], ref: str) -> Any:
    """The local JSON pointer `ref` ("#", "#/a/b") in `root`; None when it is not local or does not resolve."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _productive(root: dict[str, Any], nodes: list[dict[str, Any]]) -> bool:
    """Whether `root` has a finite value: a least fixed point over Horn clauses (a node needs all of its
    requirements; an anyOf / oneOf group one member), linear in the schema. Conservative: only the structures
    that force a value (`$ref`, `allOf`, `anyOf` / `oneOf`, an object's required properties, an array's
    minItems) count as requirements, so a schema is never refused for what it could do another way."""
    known = {id(n) for n in nodes}
    groups: list[list[Any]] = []
    needs = {id(n): _requirements(n, root, known, groups) for n in nodes}
    dependents: defaultdict[Any, list[Any]] = defaultdict(list)
    for key, reqs in needs.items():
        for req in reqs:
            dependents[req].append(key)
    for g, members in enumerate(groups):
        for member in members:
            dependents[member].append(("any", g))
    count = {key: len(reqs) for key, reqs in needs.items()}
    queue: list[Any] = [key for key, c in count.items() if c == 0]
    done: set[Any] = set()
    while queue:
        key = queue.pop()
        if key in done:
            continue
        done.add(key)
        for dep in dependents[key]:
            if isinstance(dep, tuple):  # a group: one member is enough
                queue.append(dep)
            else:
                count[dep] -= 1
                if count[dep] == 0:
                    queue.append(dep)
    return id(root) in done


def _requirements(node: dict[str, Any], root: dict[str, Any], known: set[int], groups: list[list[Any]]) -> set[Any]:
    """What `node` needs to have a value: node ids, ("any", group) or _NEVER."""

    def need(sub: Any) -> Any:
        if sub is False:
            return _NEVER
        return id(sub) if isinstance(sub, dict) and id(sub) in known else None  # anything else: no constraint

    if "const" in node or "enum" in node:
        return set()  # a literal value (llguidance checks that it fits the rest)
    reqs: list[Any] = []
    if isinstance(node.get("$ref"), str):
        reqs.append(need(_resolve(root, node["$ref"])))
    if isinstance(node.get("allOf"), list):
        reqs.extend(need(sub) for sub in node["allOf"])
    for key in ("anyOf", "oneOf"):
        members = [need(sub) for sub in node.get(key) or []] if isinstance(node.get(key), list) else []
        if members and None not in members:
            live = [m for m in members if m != _NEVER]
            groups.append(live)
            reqs.append(("any", len(groups) - 1) if live else _NEVER)
    reqs.extend(_shape_requirements(node, need))
    return {r for r in reqs if r is not None}


def _shape_requirements(node: dict[str, Any], need: Any) -> list[Any]:
    """An object's required properties, an array's first minItems items (when the type allows nothing else)."""
    types = node.get("type")
    only = types if isinstance(types, str) else types[0] if isinstance(types, list) and len(types) == 1 else None
    if only == "object" and isinstance(node.get("properties"), dict) and isinstance(node.get("required"), list):
        props = node["properties"]
        return [need(props[name]) for name in node["required"] if isinstance(name, str) and name in props]
    min_items = node.get("minItems")
    if only != "array" or isinstance(min_items, bool) or not isinstance(min_items, int) or min_items < 1:
        return []
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    reqs = [need(sub) for sub in prefix[:min_items]]
    items = node.get("items")
    if min_items > len(prefix) and (isinstance(items, dict) or items is False):
        reqs.append(need(items))
    return reqs


# ---- the compiled grammar tried ----
def short_error(message: str, no_extension: str = "the grammar allows no output at its start") -> str:
    """llguidance's error cut to its meaning: no parser-state dump (which can repeat the whole grammar), no Rust
    backtrace (frames, build paths), at most 400 characters; `no_extension` for NoExtensionBias (no token left)."""
    first = re.split(r"\n\s*<[a-z_]+>|\n\s*stack backtrace:", str(message), maxsplit=1)[0].strip()
    if "NoExtensionBias" in first:
        return no_extension
    if "symbols.len() < u16::MAX" in first:  # a panic: llguidance's grammar symbols are u16 ids
        return "the grammar is too large: over 65,000 grammar symbols (fewer or smaller tools or schemas)"
    return first[:400] or "llguidance failed"


def probe(matcher: Any, eos_ids: set[int], steps: int = PROBE_TOKENS) -> None:
    """Walk `matcher` (a disposable llguidance LLMatcher) over its first `steps` tokens, forced tokens first, else
    the lowest allowed id other than EOS; ValueError with llguidance's message when a step fails."""
    for _ in range(steps):
        mask = matcher.compute_bitmask()
        _raise_on_error(matcher)
        if matcher.is_stopped():
            return
        token = _next_token(matcher, mask, eos_ids)
        if token is None:
            return
        matcher.consume_token(token)
        _raise_on_error(matcher)


def _raise_on_error(matcher: Any) -> None:
    if matcher.is_error():
        raise ValueError(short_error(matcher.get_error()))


def _next_token(matcher: Any, mask: bytes, eos_ids: set[int]) -> int | None:
    """A forced token, else the lowest allowed id that is not EOS (None: only EOS is allowed)."""
    forced = matcher.compute_ff_tokens()
    if forced:
        return int(forced[0])
    bits = int.from_bytes(mask, "little")  # bit t is token t (llguidance's u32 words, little-endian)
    for eos in eos_ids:
        bits &= ~(1 << eos)
    return (bits & -bits).bit_length() - 1 if bits else None


# ---- the tokenizer, sendable ----
@dataclass(frozen=True)
class TokenizerSource:
    """What llguidance's LLTokenizer is built from: the fast tokenizer's JSON, the vocabulary width, EOS."""

    json: str
    n_vocab: int
    eos: int | None

    @classmethod
    def of(cls, hf_tokenizer: Any, vocab_size: int) -> TokenizerSource:
        """From a Hugging Face fast tokenizer (as llguidance.hf.from_tokenizer reads it), `vocab_size` ids wide at
        least; ValueError for a slow tokenizer."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("only fast tokenizers are supported")
        backend = copy(backend)
        backend.no_padding()
        backend.no_truncation()
        n_vocab = max(int(vocab_size), len(hf_tokenizer))
        return cls(backend.to_str(), n_vocab, hf_tokenizer.eos_token_id)

    def build(self) -> Any:
        """llguidance's LLTokenizer (a fraction of a second to a second or so)."""
        from llguidance import LLTokenizer

        return LLTokenizer(self.json, n_vocab=self.n_vocab, eos_token=self.eos)


def rss_bytes() -> int:
    """This process's resident memory (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
