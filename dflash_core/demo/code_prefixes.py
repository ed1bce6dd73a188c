"""A traffic style the demo draft was never trained on: raw Python code to continue, sent to `/v1/completions`
(an editor's code completion against a chat model). The demo target, trained partly on the standard library's
source, continues it; the demo draft, trained on chat answers only, accepts about 1.1 tokens a step on it. The
`--adapt-draft` proof (`scripts/adapt_proof.py`) and its test serve it.

`code_prefixes(n, seed)`: `n` distinct prefixes, each a function or method head and the first tokens of its body,
combined from the lists below by a seeded generator.
"""

from __future__ import annotations

import random

NAMES = ("parse_header", "load_config", "read_lines", "split_path", "normalize", "find_module", "get_option",
         "check_type", "format_date", "to_bytes", "walk_tree", "merge_dicts", "strip_comments", "quote_arg",
         "make_key", "resolve_name", "encode_value", "decode_value", "open_file", "close_all", "is_valid",
         "add_item", "remove_item", "update_cache", "clear_cache", "get_default", "set_default", "iter_chunks")
ARGS = ("path", "name", "value", "data", "key, default=None", "text", "items", "obj", "filename, mode='r'", "buf",
        "*args, **kwargs", "fp", "s, encoding='utf-8'", "node", "options=None")
CLASSES = ("Parser", "Reader", "Writer", "Cache", "Handler", "Config", "Registry", "Buffer", "Token", "Node")
IMPORTS = ("import os\nimport sys\n\n\n", "import re\n\n\n", "from collections import namedtuple\n\n\n",
           "import io\nimport struct\n\n\n")
BODIES = ("if not isinstance({a}, str):\n    raise TypeError(", "result = []\nfor ", "try:\n    return ",
          "if {a} is None:\n    return ", "with open(", "for i, item in enumerate(", "return self._",
          '"""Return the ', "data = {{}}\nfor key in ", "n = len({a})\nif n == 0:\n    return ")


def _indent(text: str, spaces: int) -> str:
    return "\n".join(" " * spaces + line for line in text.split("\n"))


def code_prefix(rng: random.Random) -> str:
    """One prefix: a function (alone, or after imports) or a method of a class, cut inside its body."""
    name, args = rng.choice(NAMES), rng.choice(ARGS)
    first = args.split(",")[0].strip("*").split("=")[0].strip()
    kind = rng.random()
    if kind < 0.3:
        cls = rng.choice(CLASSES)
        body = rng.choice(BODIES).format(a="self")
        return f'class {cls}:\n    """A {cls.lower()}."""\n\n    def {name}(self, {args}):\n{_indent(body, 8)}'
    head = rng.choice(IMPORTS) if kind > 0.8 else ""
    return f"{head}def {name}({args}):\n{_indent(rng.choice(BODIES).format(a=first), 4)}"


def code_prefixes(n: int, seed: int = 0) -> list[str]:
    """`n` distinct prefixes (ValueError when the lists cannot make that many)."""
    rng, seen, out = random.Random(seed), set(), []
    for _ in range(50 * n):
        p = code_prefix(rng)
        if p not in seen:
            seen.add(p)
            out.append(p)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} distinct code prefixes, {n} asked")
