"""Summaries of measurements (distributions, spreads, ratios) and what a result records about its run."""

from __future__ import annotations

import math
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dflash_core.bench.schema import SCHEMA_VERSION


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 (nearest rank); None without values."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(float(v) for v in values)
    out: dict[str, float | None] = {"mean": sum(xs) / len(xs)}
    for q in (50, 90, 99):
        out[f"p{q}"] = xs[max(math.ceil(q / 100 * len(xs)) - 1, 0)]
    return out


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """min, max and sample standard deviation (None under 2 values) of per-round figures."""
    xs = [float(v) for v in values]
    return {"min": min(xs), "max": max(xs), "stdev": statistics.stdev(xs) if len(xs) > 1 else None}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None when either is missing or b is 0."""
    return a / b if a is not None and b not in (None, 0) else None


def environment() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": None,
        "torch_threads": None,
        "gpu": None,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "dflash_serve": _version(),
    }
    if "torch" in sys.modules:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    return env


def _version() -> str:
    from dflash_core import __version__

    return __version__


def header(mode: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """The fields every result starts with: schema version, mode, time and command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "schema_version": SCHEMA_VERSION,
        "mode": mode,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["dflash-bench", *args]),
    }


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr (disabled: it counts but shows nothing)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled, dynamic_ncols=True, leave=False)
