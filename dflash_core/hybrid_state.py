"""What a hybrid target's Gated DeltaNet state costs, in one place: the hybrid runner
(`dflash_core.runners.hybrid`) sizes its checkpoints and the KV manager's checkpoint store with these functions, and
the memory plan (`dflash_core.memory`, before any runner exists; `dflash-bench memory`) budgets with the same ones.
Kept free of torch so the plan can use it from a config alone.

One state copy ("checkpoint") is every linear layer's convolution window (`kernel - 1` inputs of `conv_dim`
channels, model dtype) and recurrent state (`[value heads, key dim, value dim]`, float32). A running request holds:
- always, ROLLBACK_COPIES: its live state and the copy its last forward recorded for rollback (the runner's
  `conv_state` / `rec_state` and `conv_backup` / `rec_backup`, allocated once per slot);
- with checkpointing on (prefix caching), up to REQUEST_CHECKPOINTS more: its MARKS marks (`HybridSlot.marks`),
  the pending boundary state of a forward not yet accepted (`HybridSlot.pending`), and the checkpoint the engine
  keeps until its block enters the prefix index (`RequestKV.deferred`, `dflash_core.kv.requests`).
The KV manager's `CheckpointStore` holds at most `checkpoint_limits(max_slots, checkpoint)` on top.

And while a verify (or decode) step may still be rolled back, a running request holds its records: per linear
layer and token, the convolution input (`conv_dim`, model dtype) and the recurrence's key, value, decay and beta
(float32, keys repeated to the value heads) — `record_nbytes` a token, for at most the verify's width (the DFlash
block). Prefills record nothing (the chunked rule; nothing rolls a prefill back into its middle).
"""

from __future__ import annotations

MARKS = 2  # committed block-boundary states a request keeps (see HybridSlot.marks)
ROLLBACK_COPIES = 2  # the live state and the rollback copy of the last forward
REQUEST_CHECKPOINTS = MARKS + 2  # with checkpointing: the marks, the pending state, the deferred checkpoint


def checkpoint_nbytes(linear_layers: int, conv_dim: int, kernel: int, value_heads: int, key_dim: int,
                      value_dim: int, dtype_bytes: int) -> int:
    """Bytes of one state copy: every linear layer's window (`conv_dim x (kernel - 1)`, `dtype_bytes` each) and
    recurrent state (`value_heads x key_dim x value_dim`, float32)."""
    return linear_layers * (conv_dim * (kernel - 1) * dtype_bytes + value_heads * key_dim * value_dim * 4)


def record_nbytes(linear_layers: int, conv_dim: int, value_heads: int, key_dim: int, value_dim: int,
                  dtype_bytes: int) -> int:
    """Bytes a verify step records per token for rollback: every linear layer's convolution input (`conv_dim`,
    `dtype_bytes` each) and its key, value, decay and beta per value head (float32)."""
    return linear_layers * (conv_dim * dtype_bytes + value_heads * (key_dim + value_dim + 2) * 4)


def checkpoint_limits(max_slots: int, checkpoint: int) -> tuple[int, int]:
    """(count, bytes) of the KV manager's checkpoint store: one state per two slots, at least 4. A checkpoint
    pays when the next turn of a recently served conversation (or a preempted request) comes back while its blocks
    are still cached; each conversation needs one (its latest), so a count of the order of the running requests
    covers them."""
    count = max(4, max_slots // 2)
    return count, count * checkpoint


def request_state_bytes(checkpoint: int, checkpointing: bool, records: int = 0) -> int:
    """Bytes of state one running request holds at most: ROLLBACK_COPIES, plus REQUEST_CHECKPOINTS with
    checkpointing on, plus `records` (its verify step's rollback records; see the module docstring)."""
    return (ROLLBACK_COPIES + (REQUEST_CHECKPOINTS if checkpointing else 0)) * checkpoint + records

