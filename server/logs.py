"""Logging set-up for the server: one handler on the root logger, plain text or one JSON object per line.

With ``json_format`` every line the process writes through Python is a JSON object: uvicorn's ANSI-coloured
``color_message`` is dropped and escape codes are stripped, transformers' and huggingface_hub's progress bars
are turned off, transformers' own stderr handler is replaced by propagation to the root logger, and
``warnings.warn`` calls become ``py.warnings`` records.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import sys
from typing import Any, TextIO

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and goes into the JSON line.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
# Extras that only make sense on a terminal: uvicorn passes ``color_message`` (the message with ANSI codes).
_DROPPED_EXTRAS = frozenset({"color_message"})
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (colours, cursor moves)."""
    return _ANSI.sub("", text)


def _clean(value: Any) -> Any:
    return strip_ansi(value) if isinstance(value, str) else value


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object: ts, level, logger, message, plus the record's ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as a single JSON line (no ANSI codes, no ``color_message``)."""
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        payload: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": strip_ansi(record.getMessage()),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in _DROPPED_EXTRAS and not key.startswith("_"):
                payload[key] = _clean(value)
        if record.exc_info:
            payload["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            payload["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(payload, default=str)


class _DflashHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marker class so that a second ``setup_logging`` call replaces our handler instead of adding one."""


def _route_transformers(json_format: bool) -> None:
    """Send transformers' log records through the root logger; no progress bars in JSON mode."""
    if json_format:
        # Read by huggingface_hub at import (downloads) and inherited by child processes.
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    if json_format:
        hf_logging.disable_progress_bar()  # "Loading weights" etc.; turns off huggingface_hub's bars too


def setup_logging(level: str = "info", json_format: bool = False, stream: TextIO | None = None) -> None:
    """Configure the root logger (and route uvicorn's, transformers' and warnings through it); idempotent."""
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")
    handler = _DflashHandler(stream if stream is not None else sys.stderr)
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _DflashHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in _UVICORN_LOGGERS:
        uv_logger = logging.getLogger(name)
        uv_logger.handlers.clear()
        uv_logger.propagate = True
    logging.captureWarnings(True)
    _route_transformers(json_format)
