"""Recorded traffic as training data: a `dflash-serve --record-traffic` folder's shards, the held-out slice, and the
draft a run continues from (`--init-draft`).

Each record holds a request's prompt and output token ids: the output is the target's own (the server's target wrote
it), so it is the response to train on, with no regeneration. The held-out slice is chosen by the record's id (a
hash of it), so the same request is held out by every run over a folder that keeps growing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dflash_core.jsonl import JSONLError, read_jsonl
from dflash_core.train.data import UsageError

SHARDS = "traffic-*.jsonl"  # server/traffic.py's shard names
HELDOUT_FILE = "heldout.jsonl"  # the held-out records, written to the output folder


def is_traffic(path: Path) -> bool:
    """Whether `--data` names a folder of recorded traffic (rather than one JSONL file)."""
    return path.is_dir()


def read_traffic(folder: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The folder's records, oldest shard first (at most `limit`); UsageError when there are none or one is
    malformed."""
    rows: list[dict[str, Any]] = []
    shards = sorted(folder.glob(SHARDS))
    for shard in shards:
        try:
            # a server may be writing the newest shard: its half-written last line is not read
            rows += read_jsonl(shard, None if limit is None else limit - len(rows), growing=True)
        except JSONLError as exc:
            raise UsageError(str(exc)) from None
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise UsageError(f"{folder} holds no recorded traffic ({SHARDS}): serve with --record-traffic {folder}")
    for n, row in enumerate(rows, 1):
        ids = (row.get("prompt_token_ids"), row.get("output_token_ids"))
        if not isinstance(row.get("id"), str) or not all(
                isinstance(v, list) and all(isinstance(t, int) for t in v) for v in ids):
            raise UsageError(f"{folder}: record {n} lacks a string 'id' or integer 'prompt_token_ids' / "
                             f"'output_token_ids'")
    return rows


def held_out(record_id: str, fraction: float) -> bool:
    """Whether the record `record_id` belongs to the held-out slice (`fraction` of all ids, by their hash)."""
    digest = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big")
    return digest / 2**64 < fraction


def split_heldout(rows: list[dict[str, Any]], fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows) by `held_out`; UsageError when nothing is left to train on."""
    heldout = [r for r in rows if held_out(r["id"], fraction)]
    train = [r for r in rows if not held_out(r["id"], fraction)]
    if not train:
        raise UsageError(f"all {len(rows)} records fall in the held-out slice: lower --heldout-fraction")
    return train, heldout


def check_init_draft(cfg: Any, model: Any, num_layers: int) -> None:
    """UsageError (the field) when `--init-draft`'s config does not fit the target (the server's start-up check)."""
    from dflash_core.loading import check_pair

    if cfg.dflash2 is not None:  # its selector's training is not public; the convolution's block layout neither
        raise UsageError("--init-draft: a DFlash 2 draft cannot be trained here (how its candidate selector is "
                         "trained is not public): dflash-train continues DFlash drafts only")
    target = SimpleNamespace(hidden_size=int(model.config.get_text_config().hidden_size),
                             vocab_size=int(model.get_input_embeddings().weight.shape[0]), num_layers=num_layers)
    try:
        check_pair(cfg, target)  # type: ignore[arg-type]
    except ValueError as exc:
        raise UsageError(f"--init-draft: {exc}") from None
