"""Compile `fused_step.c` once per machine and load it: the shared library under the user's cache folder.

The library is built with the machine's C compiler (`cc`, or `$CC`) for the machine's own CPU (`-march=native`), so
the cache key holds the source, the flags, the compiler's version and the CPU's model and flags: a home folder
shared by machines of different CPUs never loads a library built for another. No compiler, or a failed build,
raises `CpuStepUnavailable` with the reason; the caller falls back to the PyTorch forward.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["CpuStepUnavailable", "SOURCE", "cache_dir", "load_library"]

SOURCE = Path(__file__).with_name("fused_step.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fPIC", "-shared", "-std=gnu11")
CACHE_ENV = "DFLASH_CPU_STEP_CACHE"  # where built libraries go (default: $XDG_CACHE_HOME/dflash-serve/cpu_step)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


class CpuStepUnavailable(RuntimeError):
    """The fused CPU step cannot be built or loaded here (no C compiler, a failed build)."""


def cache_dir() -> Path:
    """The folder of built libraries."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash-serve" / "cpu_step"


def _cpu_identity() -> str:
    """The CPU's model name and flags (what -march=native reads), or the platform's name where /proc is not."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep)))


def _compiler() -> list[str]:
    """The compiler's command: `$CC` split as a shell would (`ccache gcc`), else cc, gcc or clang."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise CpuStepUnavailable("no C compiler (cc, gcc or clang) on PATH")
    return [cc]


@functools.lru_cache(maxsize=8)
def _key(cc: tuple[str, ...]) -> str:
    """The library's name: a hash of the source, the flags, the compiler's version and the CPU (once per process
    and compiler command: every runner built asks, and `cc --version` is a subprocess)."""
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuStepUnavailable(f"{' '.join(cc)} --version failed: {e}") from e
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _build(cc: list[str], out: Path) -> None:
    try:  # a cache folder that cannot be made (a read-only home): the PyTorch forward, not a failed start
        out.parent.mkdir(parents=True, exist_ok=True)
        # built beside its final name and renamed: a process loading it never sees half a file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
    except OSError as e:
        raise CpuStepUnavailable(f"cannot write the library to {out.parent} ({CACHE_ENV} moves it): {e}") from e
    try:
        proc = subprocess.run([*cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise CpuStepUnavailable(f"{' '.join(cc)} failed to build {SOURCE.name}: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuStepUnavailable(f"{' '.join(cc)} could not build {SOURCE.name}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library() -> ctypes.CDLL:
    """The fused step's library, built first when this machine has no copy of it yet (a second or two)."""
    with _lock:
        cc = _compiler()
        path = cache_dir() / f"fused_step-{_key(tuple(cc))}.so"
        if str(path) in _loaded:
            return _loaded[str(path)]
        if not path.exists():
            _build(cc, path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise CpuStepUnavailable(f"could not load {path}: {e}") from e
        _loaded[str(path)] = lib
        return lib
