"""`--record-traffic DIR`: every finished request's prompt and output token ids with its acceptance figures, as
JSON lines in size-rotated shards, for fine-tuning the draft on the traffic it serves (`dflash-train --data DIR`).

Off by default. What it writes is user content (the prompts and the answers, as token ids), kept until someone
deletes it: docs/serving.md says so. A request with `"store": false` (OpenAI's field) is never recorded. The worker
thread only hands a finished request's record to `TrafficRecorder.record`, which queues it and returns at once;
a thread of the recorder's own writes the files. A write that fails (a full disk, a folder gone) stops recording
with one log line; serving goes on. A queue that fills (the disk far slower than the traffic) drops records and
says so once.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Protocol

from dflash_core.stats import SpecSummary

log = logging.getLogger("dflash.traffic")

SHARD_PREFIX = "traffic-"
SHARD_SUFFIX = ".jsonl"
QUEUE_RECORDS = 4096  # records waiting for the writer; more are dropped (and said once)


@dataclass(frozen=True)
class TrafficRecord:
    """One finished request (one choice of an HTTP request), as recorded."""

    id: str  # the response id and choice index ("chatcmpl-...-0"): the held-out split is keyed by it
    created: float
    model: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float


def finished(request_id: str, model: str, prompt: list[int], output: list[int], reason: str,
             spec: SpecSummary) -> TrafficRecord:
    """The record of a request that finished with `reason` ("stop" or "length")."""
    return TrafficRecord(id=request_id, created=time.time(), model=model, prompt_token_ids=list(prompt),
                         output_token_ids=list(output), finish_reason=reason, num_drafts=spec.num_drafts,
                         num_draft_tokens=spec.num_draft_tokens, num_accepted_tokens=spec.num_accepted_tokens,
                         mean_acceptance_length=spec.mean_acceptance_length)


class TrafficSink(Protocol):
    """Where the worker hands finished requests (`TrafficRecorder`, or a test's list)."""

    def record(self, rec: TrafficRecord) -> None:
        """Take `rec`; return at once (never block a step)."""


def shard_paths(folder: Path) -> list[Path]:
    """The folder's recorded shards, oldest first."""
    return sorted(p for p in folder.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}") if p.is_file())


class TrafficRecorder:
    """Appends records to `folder`/traffic-<start>-<pid>-<n>.jsonl, starting a new shard before one would pass
    `max_bytes`, on a writer thread of its own."""

    def __init__(self, folder: str | Path, max_bytes: int) -> None:
        """Creates the folder and checks it is writable (OSError at start-up otherwise)."""
        if max_bytes < 1024:
            raise ValueError(f"record_max_bytes must be at least 1 KiB, got {max_bytes}")
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        if not os.access(self.folder, os.W_OK):
            raise OSError(f"{self.folder} is not writable")
        self.max_bytes = max_bytes
        self._stem = f"{SHARD_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self._shard = 0
        self._file: IO[str] | None = None
        self._size = 0
        self._queue: queue.Queue[TrafficRecord | None] = queue.Queue(QUEUE_RECORDS)
        self._stopped = threading.Event()  # a write failed, or close(): nothing more is written
        self._dropped = 0
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="dflash-traffic", daemon=True)
        self._thread.start()

    @property
    def recording(self) -> bool:
        """Whether records are still written (False after a failed write or `close`)."""
        return not self._stopped.is_set()

    def record(self, rec: TrafficRecord) -> None:
        """Queue `rec` for the writer; never blocks nor raises (a full queue drops it, said once)."""
        if self._stopped.is_set():
            return
        try:
            self._queue.put_nowait(rec)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("traffic recording is behind the traffic: records are dropped until it catches up")

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop (idempotent)."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
        self._stopped.set()

    def _run(self) -> None:
        while True:
            rec = self._queue.get()
            if rec is None or self._stopped.is_set():
                break
            try:
                self._write(json.dumps(asdict(rec), separators=(",", ":")) + "\n")
            except OSError as exc:  # a full disk, a folder removed: recording stops, serving does not
                log.error("traffic recording stopped: %s (serving goes on)", exc)
                self._stopped.set()
                break
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass

    def _write(self, line: str) -> None:
        data = len(line.encode())
        if self._file is None or (self._size and self._size + data > self.max_bytes):
            if self._file is not None:
                self._file.close()
            self._shard += 1
            self._file = open(self.folder / f"{self._stem}-{self._shard:04d}{SHARD_SUFFIX}", "a",  # noqa: SIM115
                              encoding="utf-8")
            self._size = 0
        self._file.write(line)
        self._file.flush()  # a reader (dflash-train) sees whole lines
        self._size += data
        self.written += 1
