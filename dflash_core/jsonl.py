"""JSON-lines files: prompt sets, training data, held-out sets. Errors name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class JSONLError(ValueError):
    """A JSONL file that is missing, malformed, or has a line that is not a JSON object."""


def read_jsonl(path: str | Path, limit: int | None = None, growing: bool = False) -> list[dict[str, Any]]:
    """The JSON objects of a file, one per non-blank line (the first `limit` when given). `growing`: the file is
    being appended to, and a last line without its newline (half written) is left out."""
    path = Path(path)
    if not path.is_file():
        raise JSONLError(f"{path} does not exist")
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or (growing and not line.endswith("\n")):
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise JSONLError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise JSONLError(f"{path}:{n}: each line must be a JSON object")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write rows as JSON lines."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
