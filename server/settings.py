"""Server settings: the engine's (``EngineConfig``) plus the HTTP ones; flag > environment (``DFLASH_*``) >
YAML config > default.

The merge is hand-written rather than pydantic-settings: it keeps ``Settings`` a frozen dataclass subclass of
``EngineConfig`` (one definition of every engine field) and gives one-line errors that name the flag, variable or
file a bad value came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

import yaml

from dflash_core.config import EngineConfig

ENV_PREFIX = "DFLASH_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _setting(default: Any, help: str) -> Any:
    """A field with the help text that ``--help`` shows."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Settings(EngineConfig):
    """Every setting of the server: the engine's fields (inherited), then the HTTP ones. Names equal the YAML
    keys and (upper-cased) the DFLASH_ variables. Frozen: change one with ``dataclasses.replace``."""

    host: str = _setting("127.0.0.1", "bind address")
    port: int = _setting(8000, "bind port")
    max_waiting_requests: int = _setting(64, "requests queued beyond the running ones before answering 429")
    served_model_name: str | None = _setting(None, "model name in the API (default: the target's folder name)")
    api_key: str | None = _setting(None, "require 'Authorization: Bearer KEY' on /v1 (default: none, no key needed)")
    log_level: str = _setting("info", "debug, info, warning, error")
    log_json: bool = _setting(False, "log one JSON object per line (progress bars off, warnings as records)")
    limit_concurrency: int = _setting(
        1024,
        "open connections (idle ones count) or requests in progress beyond which a new request gets a "
        "fast 503 instead of queueing in the kernel",
    )
    keep_alive_timeout: float = _setting(5.0, "seconds an idle keep-alive connection stays open between requests")
    header_timeout: float = _setting(
        10.0,
        "seconds a client has to send a request's headers once connected (or after the previous "
        "response); slower connections are closed (slow-loris protection)",
    )
    shutdown_timeout: float = _setting(
        30.0,
        "on SIGTERM / SIGINT: seconds running requests may take to finish before streams get an error "
        "event and queued requests a 503 (a second signal exits at once)",
    )
    allow_special_tokens: bool = _setting(
        False,
        "tokenize special-token text inside message content as special tokens; off so that user text "
        "cannot forge turns",
    )
    sse_ping_interval: float = _setting(15.0, "seconds between SSE keep-alive comments on quiet streams")

    def validate(self) -> None:
        """Raise ValueError on an impossible setting (the engine's first; runs on construction)."""
        super().validate()
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be debug, info, warning, error or critical: {self.log_level!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in 0..65535")
        if self.limit_concurrency < 1:
            raise ValueError("limit_concurrency must be >= 1")
        for name, value in (
            ("keep_alive_timeout", self.keep_alive_timeout),
            ("header_timeout", self.header_timeout),
            ("sse_ping_interval", self.sse_ping_interval),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be >= 0")

    def public_dict(self) -> dict[str, Any]:
        """Settings for logs, the API key masked."""
        d = dataclasses.asdict(self)
        if d["api_key"]:
            d["api_key"] = "***"
        return d


_FIELDS = {f.name: f for f in fields(Settings)}


def _base_type(name: str) -> type:
    hint = typing.get_type_hints(Settings)[name]
    if isinstance(hint, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint


def _is_optional(name: str) -> bool:
    hint = typing.get_type_hints(Settings)[name]
    return isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)


def convert(name: str, raw: Any, source: str) -> Any:
    """Convert a YAML / environment value to the setting's type (ValueError naming the source)."""
    base = _base_type(name)
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null")):
        if _is_optional(name):
            return None
        raise ValueError(f"{source}: '{name}' must not be empty")
    if base is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{source}: '{name}' must be a boolean, got {raw!r}")
    if base is int:
        if isinstance(raw, bool):
            raise ValueError(f"{source}: '{name}' must be an integer, got {raw!r}")
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{source}: '{name}' must be an integer, got {raw!r}") from None
    if base is float:
        value = None
        if not isinstance(raw, bool):
            try:
                value = float(raw)
            except (TypeError, ValueError):
                pass
        if value is None or not math.isfinite(value):
            raise ValueError(f"{source}: '{name}' must be a number, got {raw!r}")
        return value
    return str(raw)


class UsageError(ValueError):
    """A command line argparse cannot parse (unknown flag, missing value): one line, exit 2, like bad values."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise UsageError instead of printing the usage and exiting."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        """Raise instead of printing the whole usage (``--help`` is unchanged)."""
        raise UsageError(message)


def read_yaml(path: str) -> Any:
    """The parsed YAML file (ValueError, in one line, for malformed YAML)."""
    with open(path, encoding="utf-8") as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: malformed YAML: {' '.join(str(e).split())}") from None


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML config; unknown keys are an error (catches typos)."""
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise TypeError(f"{path}: expected a mapping of setting names to values")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
    return {k: convert(k, v, path) for k, v in data.items()}


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash-serve`` command line: one flag per setting plus ``--config``."""
    p = _Parser(
        prog="dflash-serve",
        description="OpenAI-compatible server with DFlash speculative decoding. "
        "Precedence: flag > DFLASH_* environment > --config YAML > default.",
    )
    p.add_argument("--config", default=None, help="YAML file whose keys are setting names (env: DFLASH_CONFIG)")
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if f.default is not None:  # a None default is described in the help text itself
            default = ("on" if f.default else "off") if isinstance(f.default, bool) else f.default
            help_text += f" (default: {default})"
        help_text = f"{help_text} (env: {ENV_PREFIX}{f.name.upper()})".replace("%", "%%")
        base = _base_type(f.name)
        if base is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            p.add_argument(flag, dest=f.name, default=None, help=help_text, metavar=f.name.upper())
    return p


def resolve_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Merge flags, environment, YAML and defaults into Settings (ValueError, in one line, for a bad value)."""
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    config = args.config or env.get(ENV_PREFIX + "CONFIG")
    if config:
        values.update(load_yaml(config))
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in env:
            values[name] = convert(name, env[key], f"environment {key}")
    for name in _FIELDS:
        value = getattr(args, name)
        if value is not None:
            values[name] = convert(name, value, "flag --" + name.replace("_", "-"))
    return Settings(**values)  # validates (ValueError naming the setting)
