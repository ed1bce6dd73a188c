"""Runners: what executes models for the engine. `base` holds the interfaces (TargetRunner, Drafter); `native`
(with `hybrid`), `generic` and `hf` are the target backends, `paged` what the paged ones share; `drafter` is the
DFlash drafter."""

from dflash_core.runners.base import (
    Drafter,
    DraftRequest,
    PerRequestDrafter,
    TargetOutput,
    TargetRow,
    TargetRunner,
)

__all__ = ["Drafter", "DraftRequest", "PerRequestDrafter", "TargetOutput", "TargetRow", "TargetRunner"]
