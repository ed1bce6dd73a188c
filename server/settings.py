"""Server settings: the engine's (``EngineConfig``) plus the HTTP ones; flag > environment (``DFLASH_*``) >
YAML config > default.

The merge is hand-written rather than pydantic-settings: it keeps ``Settings`` a frozen dataclass subclass of
``EngineConfig`` (one definition of every engine field) and gives one-line errors that name the flag, variable or
file a bad value came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

import yaml

from dflash_core.config import EngineConfig
from dflash_core.memory import parse_bytes
from server.generation_config import GENERATION_CONFIG_MODES
from server.reasoning import REASONING_STYLES
from server.tools import TOOL_PARSERS

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
    api_key: str | None = _setting(None, "require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize; "
                                   "/health, /metrics and /docs stay open (default: none, no key needed)")
    log_level: str = _setting("info", "debug, info, warning, error")
    log_json: bool = _setting(False, "log one JSON object per line (progress bars off, warnings as records)")
    limit_concurrency: int = _setting(
        1024,
        "open connections (idle ones count) or requests in progress beyond which a new request gets a "
        "fast 503 instead of queueing in the kernel",
    )
    keep_alive_timeout: float = _setting(5.0, "seconds an idle keep-alive connection stays open between requests")
    one_core: bool | None = _setting(
        None, "run the event loop and the worker thread on one core after warm-up: the two take turns holding "
        "Python's GIL, and a hand-off between cores costs a cross-core wake-up (default: on for a CPU device with "
        "one torch thread running PyTorch's forward; off with the fused CPU step, whose C call lets the loop work "
        "on another core, and elsewhere; Linux)")
    header_timeout: float = _setting(
        10.0,
        "seconds a client has to send a request's headers once connected (or after the previous "
        "response), and the longest pause between two chunks of its body; slower connections are closed "
        "(slow-loris protection)",
    )
    body_timeout: float = _setting(
        60.0, "seconds a client has to send a request's whole body; beyond, a 408 and a closed connection")
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
    speculative_config: str | None = _setting(
        None,
        "vLLM's spelling of the draft, as JSON: {\"method\": \"dflash\", \"model\": DRAFT, "
        "\"num_speculative_tokens\": N} sets --draft DRAFT and --block-size N+1 (default: none)",
    )
    generation_config: str = _setting(
        "auto",
        "sampling defaults for fields a request omits: auto (the target's generation_config.json, as vLLM), "
        "none, or a folder holding a generation_config.json",
    )
    chat_template: str | None = _setting(
        None, "chat template (a file, or the template text) instead of the model's (default: the model's)"
    )
    trust_request_chat_template: bool = _setting(
        False,
        "run a request's own chat_template field (client Jinja: unbounded run time, and its text may hold "
        "special tokens); off: such a request is a 400, as in vLLM",
    )
    reasoning_parser: str | None = _setting(
        None, "move thinking text to reasoning_content: qwen3 or deepseek_r1 (default: none, thinking stays content)"
    )
    tool_call_parser: str | None = _setting(
        None,
        "read tool calls from the model's text: hermes (Qwen, Hermes) or llama3_json (Llama 3.x) (default: none; "
        "tool_choice required / named then use hermes)",
    )
    enable_auto_tool_choice: bool = _setting(
        False, "let the model decide to call tools (tool_choice auto); needs --tool-call-parser"
    )
    grammar_compile_timeout: float = _setting(
        30.0,
        "seconds a request's grammar (response_format, forced tool calls) may take to compile in a helper process "
        "before the request gets a 400",
    )
    record_traffic: str | None = _setting(
        None, "record every finished request's prompt and output token ids, with its acceptance figures, as JSON "
        "lines in this folder (user content, kept until deleted; a request with \"store\": false is not "
        "recorded), for dflash-train --data FOLDER (default: none, nothing recorded)")
    record_max_bytes: str = _setting(
        "64MiB", "size of one --record-traffic shard: a new file is started before one would grow past it")
    adapt_draft: bool = _setting(
        False, "fine-tune the draft on the recorded traffic (needs --record-traffic) in a background process on a "
        "schedule (--adapt-interval), and swap the new draft in without a restart when it beats the serving one on "
        "a held-out slice of the records (--adapt-gate-margin)")
    adapt_interval: float = _setting(3600.0, "--adapt-draft: seconds between looks at the records")
    adapt_min_records: int = _setting(
        500, "--adapt-draft: new recorded requests a fine-tuning cycle waits for")
    adapt_steps: int = _setting(400, "--adapt-draft: optimizer steps of a cycle (dflash-train --steps)")
    adapt_threads: int = _setting(
        1, "--adapt-draft: CPU threads of the training process (it runs at the lowest priority, off the worker's "
        "core)")
    adapt_device: str = _setting(
        "cpu", "--adapt-draft: device of the training process (cpu, cuda, cuda:N; on the serving GPU it competes "
        "with serving: give it another one)")
    adapt_gate_margin: float = _setting(
        0.05, "--adapt-draft: a new draft is swapped in only when its held-out acceptance length beats the serving "
        "one's by this share")
    adapt_dir: str | None = _setting(
        None, "--adapt-draft: folder of the cycles' drafts and reports (default: RECORD_TRAFFIC/adapted)")
    adapt_train_args: str | None = _setting(
        None, "--adapt-draft: more dflash-train options for each cycle, as one string (e.g. '--lr 3e-4 "
        "--cache-hidden') (default: none)")
    allowed_origins: str | None = _setting(
        None, "CORS: origins allowed to call the API from a browser, a JSON list such as '[\"*\"]' (default: none)"
    )

    def __post_init__(self) -> None:
        """Apply ``speculative_config`` to the engine fields, then validate."""
        if self.speculative_config is not None:
            draft, block_size = parse_speculative_config(self.speculative_config)
            if self.draft is not None and self.draft != draft:
                raise ValueError(f"draft {self.draft!r} and speculative_config's model {draft!r} differ")
            if block_size is not None and self.block_size is not None and self.block_size != block_size:
                raise ValueError(
                    f"block_size {self.block_size} and speculative_config's num_speculative_tokens + 1 "
                    f"({block_size}) differ"
                )
            object.__setattr__(self, "draft", draft)
            object.__setattr__(self, "block_size", block_size if block_size is not None else self.block_size)
        super().__post_init__()

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
            ("body_timeout", self.body_timeout),
            ("sse_ping_interval", self.sse_ping_interval),
            ("grammar_compile_timeout", self.grammar_compile_timeout),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be >= 0")
        if parse_bytes(self.record_max_bytes) < 1024:
            raise ValueError(f"record_max_bytes must be at least 1KiB, got {self.record_max_bytes!r}")
        self._validate_adaptation()
        self._validate_api_surface()

    def _validate_adaptation(self) -> None:
        """--adapt-draft and its settings."""
        if self.adapt_draft and self.record_traffic is None:
            raise ValueError("adapt_draft needs record_traffic: the draft learns from the recorded requests")
        if self.adapt_draft and (not self.speculative or (self.target is not None and self.draft is None)):
            raise ValueError("adapt_draft needs a draft (--draft; --no-speculative serves none) to fine-tune")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.adapt_device):
            raise ValueError(f"adapt_device must be cpu, cuda or cuda:N, got {self.adapt_device!r}")
        if self.adapt_interval <= 0:
            raise ValueError("adapt_interval must be > 0")
        for name in ("adapt_min_records", "adapt_steps", "adapt_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.adapt_gate_margin < 0:
            raise ValueError("adapt_gate_margin must be >= 0")
        try:
            shlex.split(self.adapt_train_args or "")
        except ValueError as exc:
            raise ValueError(f"adapt_train_args: {exc}") from None

    def _validate_api_surface(self) -> None:
        """The parsers, the chat template, CORS origins and generation defaults."""
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_STYLES:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_STYLES)}, got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes or llama3_json)")
        if self.chat_template is not None:
            self.chat_template_text()
        self.origins()
        mode = self.generation_config
        if mode not in GENERATION_CONFIG_MODES and not os.path.isdir(os.path.expanduser(mode)):
            raise ValueError(f"generation_config must be auto, none or a folder, got {mode!r}")

    def chat_template_text(self) -> str | None:
        """The ``chat_template`` setting's template: a file's text, or the setting itself when it is a template."""
        value = self.chat_template
        if value is None:
            return None
        path = os.path.expanduser(value)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
        if "{{" in value or "{%" in value:
            return value
        raise ValueError(f"chat_template: {value!r} is neither a file nor a template")

    def origins(self) -> list[str]:
        """The CORS origins (``allowed_origins``: a JSON list, or comma-separated)."""
        raw = (self.allowed_origins or "").strip()
        if not raw:
            return []
        if raw.startswith("["):
            try:
                value = json.loads(raw)
            except ValueError:
                value = None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"allowed_origins must be a JSON list of strings, got {raw!r}")
            return value
        return [v.strip() for v in raw.split(",") if v.strip()]

    def public_dict(self) -> dict[str, Any]:
        """Settings for logs, the API key masked."""
        d = dataclasses.asdict(self)
        if d["api_key"]:
            d["api_key"] = "***"
        return d


_FIELDS = {f.name: f for f in fields(Settings)}
# vLLM's spellings of our flags (the flag of each setting stays too)
FLAG_ALIASES = {"target": ("--model",), "max_running_requests": ("--max-num-seqs",)}
SPECULATIVE_METHODS = ("dflash",)
_SPECULATIVE_KEYS = frozenset({"method", "model", "num_speculative_tokens"})


def parse_speculative_config(raw: str) -> tuple[str, int | None]:
    """(draft, block size or None) of a ``--speculative-config`` JSON object (ValueError naming the problem)."""
    try:
        spec = json.loads(raw)
    except ValueError:
        raise ValueError(f"speculative_config must be a JSON object, got {raw!r}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {raw!r}")  # noqa: TRY004 - a settings error
    unknown = sorted(set(spec) - _SPECULATIVE_KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: method, model, "
                         "num_speculative_tokens")
    method = spec.get("method", "dflash")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config.method must be 'dflash', got {method!r}")
    draft = spec.get("model")
    if not isinstance(draft, str) or not draft:
        raise ValueError("speculative_config.model must name the DFlash draft (a folder or hub id)")
    n = spec.get("num_speculative_tokens")
    if n is None:
        return draft, None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"speculative_config.num_speculative_tokens must be a positive integer, got {n!r}")
    return draft, n + 1


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
    empty = raw is None or (isinstance(raw, str) and raw.strip() == "")
    nullish = isinstance(raw, str) and raw.strip().lower() in ("none", "null")
    if empty or nullish:
        if _is_optional(name):
            return None
        if not (nullish and base is str):  # a text setting's "none" is a value (--generation-config none)
            raise ValueError(f"{source}: '{name}' must not be empty")
    if base is str and isinstance(raw, (list, dict)):  # a YAML list or mapping for a JSON setting
        return json.dumps(raw)
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
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help="the target (vLLM style): same as --target")
    for f in fields(Settings):
        flags = ["--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ())]
        help_text = f.metadata.get("help", "")
        if f.default is not None:  # a None default is described in the help text itself
            default = ("on" if f.default else "off") if isinstance(f.default, bool) else f.default
            help_text += f" (default: {default})"
        help_text = f"{help_text} (env: {ENV_PREFIX}{f.name.upper()})".replace("%", "%%")
        base = _base_type(f.name)
        if base is bool:
            p.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            p.add_argument(*flags, dest=f.name, default=None, help=help_text, metavar=f.name.upper())
    return p


def resolve_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Merge flags, environment, YAML and defaults into Settings (ValueError, in one line, for a bad value)."""
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}  # where each value came from, for a value that fails validation
    config = args.config or env.get(ENV_PREFIX + "CONFIG")
    if config:
        values.update(load_yaml(config))
        sources.update(dict.fromkeys(values, str(config)))
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in env:
            values[name] = convert(name, env[key], f"environment {key}")
            sources[name] = f"environment {key}"
    if args.model is not None:
        if args.target is not None and args.target != args.model:
            raise ValueError(f"the positional MODEL {args.model!r} and --target/--model {args.target!r} differ")
        args.target = args.model
    for name in _FIELDS:
        value = getattr(args, name)
        if value is not None:
            values[name] = convert(name, value, "flag --" + name.replace("_", "-"))
            sources[name] = "flag --" + name.replace("_", "-")
    try:
        return Settings(**values)  # validates (ValueError naming the setting)
    except ValueError as exc:  # a message that starts with a setting's name: say where its value came from
        named = str(exc).split(" ", 1)[0]
        if named in sources:
            raise ValueError(f"{sources[named]}: {exc}") from None
        raise
