"""``--generation-config``: the sampling defaults of the model's ``generation_config.json``, as vLLM applies them.

``auto`` (the default) reads the target's ``generation_config.json`` (a folder, or a hub id in the local cache) and
uses its ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as
``max_tokens``) for requests that do not set them; ``none`` (or vLLM's ``vllm``) ignores the file; any other value
is a folder that holds a ``generation_config.json``. A request's own values always win.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

log = logging.getLogger("dflash.server")

GENERATION_CONFIG_MODES = ("auto", "none", "vllm")
FILE_NAME = "generation_config.json"
_KEYS = {  # generation_config.json key -> default
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults for fields a request omits (None: the server's own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerationDefaults:
        """The defaults a ``generation_config.json`` gives (other keys ignored, as vLLM does)."""
        values: dict[str, Any] = {}
        for key, name in _KEYS.items():
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            values[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
        return cls(**values)

    def given(self) -> dict[str, Any]:
        """The defaults that are set (for the start-up log)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _file_of(mode: str, target: str) -> Path | None:
    """Where the ``generation_config.json`` of ``mode`` lies, or None when there is none."""
    folder = Path(target if mode == "auto" else mode).expanduser()
    if folder.is_dir():
        path = folder / FILE_NAME
        return path if path.is_file() else None
    if mode != "auto":
        return None
    try:  # a hub id: the file in the local cache (downloaded with the model); never the network
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(target, FILE_NAME)
    except Exception:  # noqa: BLE001 - not a valid repo id: no defaults
        return None
    return Path(found) if isinstance(found, str) else None


def load_generation_defaults(mode: str, target: str) -> GenerationDefaults:
    """The defaults of ``--generation-config MODE`` for the model ``target`` (a folder or hub id)."""
    if mode in ("none", "vllm"):
        return GenerationDefaults()
    path = _file_of(mode, target)
    if path is None:
        if mode != "auto":
            log.warning("--generation-config %s: no %s there; using no defaults", mode, FILE_NAME)
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s cannot be read (%s); using no generation defaults", path, e)
        return GenerationDefaults()
    defaults = GenerationDefaults.from_dict(raw if isinstance(raw, dict) else {})
    if defaults.given():
        log.info("generation defaults from %s: %s (--generation-config none ignores them)", path, defaults.given())
    return defaults
