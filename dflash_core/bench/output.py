"""Where `dflash-bench` writes its results, and how: the output folder, file names, the JSON file."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from dflash_core.bench.errors import BenchError
from dflash_core.bench.schema import validate

BENCH_DIR_ENV = "DFLASH_BENCH_DIR"
DEFAULT_DIR_NAME = "bench-results"


def safe_name(label: str) -> str:
    """A run label as a file-name part."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write, then validate (a schema failure is a bug in dflash-bench; the measurements stay on disk)."""
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    validate(result)


def _writable_dir(path: Path) -> str | None:
    """Create `path` if needed and write a probe file in it; None when that works, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".dflash-bench-probe"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def default_output_dirs() -> list[Path]:
    """Where results go without --output-dir or $DFLASH_BENCH_DIR, in order: the first writable one wins."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    dirs = [Path(DEFAULT_DIR_NAME)]
    try:
        dirs.append(Path.home() / DEFAULT_DIR_NAME)
    except RuntimeError:  # no HOME and no passwd entry
        pass
    return [*dirs, Path(tempfile.gettempdir()) / f"dflash-bench-results-{uid}"]


def resolve_output_dir(explicit: Path | None) -> Path:
    """The output folder, created and checked writable before any measuring.

    --output-dir, else $DFLASH_BENCH_DIR: used as given, a BenchError (exit 2) when not writable. Else the
    first writable of ./bench-results, ~/bench-results and <temp dir>/dflash-bench-results-<uid>, with a note
    on stderr when it is not the first."""
    env = os.environ.get(BENCH_DIR_ENV, "").strip()
    if explicit is not None or env:
        path, origin = (explicit, "--output-dir") if explicit is not None else (Path(env), f"${BENCH_DIR_ENV}")
        path = path.expanduser()
        why = _writable_dir(path)
        if why:
            raise BenchError(
                f"output folder {path} ({origin}) is not writable ({why}); pass --output-dir or set "
                f"{BENCH_DIR_ENV} to a folder you can write"
            )
        return path
    skipped = []
    for path in default_output_dirs():
        why = _writable_dir(path)
        if why is None:
            if skipped:
                print(
                    f"dflash-bench: {'; '.join(skipped)}; writing results to {path} "
                    f"(--output-dir or ${BENCH_DIR_ENV} choose the folder)",
                    file=sys.stderr,
                )
            return path
        skipped.append(f"{path.absolute()} is not writable ({why})")
    raise BenchError(f"no writable output folder: {'; '.join(skipped)}; pass --output-dir or set {BENCH_DIR_ENV}")
