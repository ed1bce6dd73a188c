"""Runners: what executes models for the engine. `base` holds the interfaces (TargetRunner, Drafter); `hf` and
`native` are the two target backends; `drafter` is the DFlash drafter."""

from dflash_core.runners.base import (
    Drafter,
    DraftRequest,
    PerRequestDrafter,
    TargetOutput,
    TargetRow,
    TargetRunner,
)

__all__ = ["Drafter", "DraftRequest", "PerRequestDrafter", "TargetOutput", "TargetRow", "TargetRunner"]
