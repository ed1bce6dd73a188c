"""Checkpoints and the final draft: atomic writes with normal file modes (readable by the serving user)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dflash_core.draft import DFlashDraft

CHECKPOINT_DIR = "checkpoint"
DATA_FILE = "train_data.pt"


def _umask() -> int:
    """The process's umask (read without changing it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_modes(path: Path) -> None:
    """Make a written file or folder (recursively) readable like a normal file: 0644 / 0755 less the umask.

    tempfile.mkdtemp makes 0700 folders and safetensors writes 0600 files; weights written that way are
    unreadable to anyone else, e.g. the serving container's user (uid 1000)."""
    mask = _umask()
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        if not p.is_symlink():
            p.chmod((0o755 if p.is_dir() else 0o644) & ~mask)


def atomic_dir_write(final: Path, write: Any) -> None:
    """Write a folder through a temporary sibling, then swap it in: never a half-written checkpoint."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=final.parent))
    try:
        write(tmp)
        share_modes(tmp)
        old = final.with_name(f".{final.name}.old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(out: Path, draft: DFlashDraft, opt: torch.optim.Optimizer, step: int, gen: torch.Generator) -> None:
    """OUT/checkpoint: the draft, the optimizer, the step and both random states (what --resume continues from)."""

    def write(tmp: Path) -> None:
        draft.save(tmp)
        torch.save({"step": step, "optimizer": opt.state_dict(), "gen": gen.get_state(),
                    "torch_rng": torch.get_rng_state()}, tmp / "trainer_state.pt")

    atomic_dir_write(out / CHECKPOINT_DIR, write)


def save_final(out: Path, draft: DFlashDraft) -> None:
    """config.json + model.safetensors into the output folder, each file replaced atomically."""
    tmp = Path(tempfile.mkdtemp(prefix=".final.tmp", dir=out))
    try:
        draft.save(tmp)
        share_modes(tmp)
        for name in ("model.safetensors", "config.json"):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
