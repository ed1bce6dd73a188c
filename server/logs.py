"""Logging set-up for the server: one handler on the root logger, plain text or one JSON object per line."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and goes into the JSON line.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object: ts, level, logger, message, plus the record's ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as a single JSON line."""
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        payload: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class _DflashHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marker class so that a second ``setup_logging`` call replaces our handler instead of adding one."""


def setup_logging(level: str = "info", json_format: bool = False, stream: TextIO | None = None) -> None:
    """Configure the root logger (and route uvicorn's loggers through it); safe to call more than once."""
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
