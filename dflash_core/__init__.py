"""dflash_core: the DFlash speculative-decoding engine (no HTTP).

    from dflash_core import LLM, SamplingParams

``LLM``, ``SamplingParams`` and ``EngineConfig`` are imported on first use, so that importing the package stays
cheap and can run before torch is loaded (see below).

Importing this package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it, and only
when torch has not been imported yet (the OpenMP runtime reads the variable once, when torch loads it; setting
it afterwards would change nothing and only mislead). On a CPU shared with other processes, OpenMP workers
that spin while idle make every small forward many times slower; PASSIVE lets them sleep. Every entry point
(``dflash-serve``, ``dflash-train``, ``dflash-bench``) and every library user that imports ``dflash_core``
before torch gets it; set ``OMP_WAIT_POLICY`` yourself to choose otherwise.
"""

from __future__ import annotations

import importlib as _importlib
import os as _os
import sys as _sys
from typing import Any as _Any

__version__ = "0.1.0"
__all__ = ["LLM", "EngineConfig", "Generation", "SamplingParams", "StreamChunk"]

_LAZY = {
    "LLM": "dflash_core.llm",
    "Generation": "dflash_core.llm",
    "StreamChunk": "dflash_core.llm",
    "EngineConfig": "dflash_core.config",
    "SamplingParams": "dflash_core.sampling",
}


def _default_omp_wait_policy() -> None:
    if "torch" not in _sys.modules:
        _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dflash_core' has no attribute {name!r}")


_default_omp_wait_policy()
