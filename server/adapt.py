"""``--adapt-draft``: the draft learns from the traffic it serves. Every ``--adapt-interval`` seconds, once
``--adapt-min-records`` new requests have been recorded (``--record-traffic``), one cycle runs:

1. **fine-tune**: ``dflash-train --init-draft <serving draft> --data <record folder> --eval-heldout`` in a child
   process, at the lowest CPU priority, with ``--adapt-threads`` threads, on the cores the worker is not pinned
   to, on ``--adapt-device`` (the CPU by default);
2. **gate**: the child measures the serving draft and the new one on the held-out slice of the records (by request
   id, never trained on) with the engine, and promotes the new one only when its acceptance length is better by
   ``--adapt-gate-margin`` (``OUTPUT/gate.json``);
3. **swap**: a promoted draft replaces the serving one between two steps (``server.draft_swap``): no request fails
   and no token changes.

Each cycle's folder is ``<adapt dir>/cycle-NNNN`` (the draft, ``gate.json``, ``train.log``, ``cycle.json``); its
report is logged in one line. Serving never waits on a cycle: the training is another process, the swap a copy of
the weights at a step boundary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server import affinity
from server.draft_swap import DraftSwapError, DraftSwapper
from server.traffic import shard_paths

if TYPE_CHECKING:
    from server.settings import Settings

log = logging.getLogger("dflash.adapt")

NICE = 19  # the trainer's CPU priority: the serving process always comes first


@dataclass(frozen=True)
class AdaptSettings:
    """What a cycle needs (from the server's settings)."""

    target: str  # the target's folder or hub id (the trainer loads it in float32)
    records: Path  # --record-traffic
    folder: Path  # where the cycles' drafts go (--adapt-dir; default: <records>/adapted)
    interval_s: float
    min_records: int
    steps: int
    threads: int
    device: str
    gate_margin: float
    train_args: tuple[str, ...] = ()  # more dflash-train options (--adapt-train-args)


@dataclass
class CycleReport:
    """One cycle: what it trained on, the gate's figures and what became of the new draft."""

    cycle: int
    records: int  # recorded requests in the folder when the cycle started
    output: str
    train_seconds: float
    returncode: int
    old_acceptance_length: float | None = None
    new_acceptance_length: float | None = None
    old_estimated_speedup: float | None = None
    new_estimated_speedup: float | None = None
    promoted: bool = False
    draft_version: int | None = None  # after a swap
    error: str | None = None


def count_records(folder: Path) -> int:
    """Complete records (lines) in the folder's shards."""
    total = 0
    for shard in shard_paths(folder):
        try:
            with open(shard, "rb") as f:
                total += sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))  # noqa: B023
        except OSError:
            continue
    return total


class DraftAdapter:
    """Runs the cycles on a thread of its own (`start`), or one at a time (`run_cycle`)."""

    def __init__(self, settings: AdaptSettings, swapper: DraftSwapper) -> None:
        self.settings, self._swapper = settings, swapper
        self._stop = threading.Event()
        self._child_lock = threading.Lock()  # `_child` and `_stop` together: a stop never misses a child
        self._child: subprocess.Popen[bytes] | None = None
        self._trained_on = 0  # records in the folder when the last cycle started
        self.cycles = last_cycle(settings.folder)  # numbers go on after a restart (and after deleted cycles)
        self._thread = threading.Thread(target=self._run, name="dflash-adapt", daemon=True)

    def start(self) -> None:
        self._thread.start()
        s = self.settings
        log.info("adapting the draft: every %g s once %d new requests are recorded in %s (%d steps on %s, "
                 "%d thread(s), gate margin %.0f%%)", s.interval_s, s.min_records, s.records, s.steps, s.device,
                 s.threads, 100 * s.gate_margin)

    def stop(self) -> None:
        """End the loop; a training child is ended (its process group: SIGTERM, SIGKILL after 10 s)."""
        with self._child_lock:
            self._stop.set()
            child = self._child
        if child is not None:
            _end(child)
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            try:
                self.run_cycle()
            except Exception:  # a cycle's bug must not end the loop, nor touch serving
                log.exception("draft adaptation cycle failed")

    def run_cycle(self, force: bool = False) -> CycleReport | None:
        """One cycle, when enough new requests were recorded (or `force`); None when it did not run."""
        s = self.settings
        records = count_records(s.records)
        if not force and records - self._trained_on < s.min_records:
            log.debug("draft adaptation: %d new records of %d needed", records - self._trained_on, s.min_records)
            return None
        current = self._swapper.current
        if current is None:
            return None
        self._trained_on = records
        self.cycles += 1
        out = s.folder / f"cycle-{self.cycles:04d}"
        t0 = time.perf_counter()
        code = self._train(current, out)
        if self._stop.is_set():  # the server is shutting down: the child was ended, nothing to report
            log.info("draft adaptation cycle %d stopped: the server is shutting down", self.cycles)
            return None
        report = CycleReport(self.cycles, records, str(out), time.perf_counter() - t0, code)
        gate = _read_json(out / "gate.json")
        if code != 0 or gate is None:
            report.error = f"dflash-train exited {code} (see {out / 'train.log'})"
        else:
            report.old_acceptance_length = gate["old"]["acceptance_length"]
            report.new_acceptance_length = gate["new"]["acceptance_length"]
            report.old_estimated_speedup = gate["old"].get("estimated_speedup")
            report.new_estimated_speedup = gate["new"].get("estimated_speedup")
            report.promoted = bool(gate["promote"])
        if report.promoted:
            try:
                report.draft_version = self._swapper.swap(str(out)).draft_version
            except DraftSwapError as exc:
                report.promoted, report.error = False, f"swap failed: {exc}"
        (out / "cycle.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
        _log_report(report)
        return report

    def _train(self, current: str, out: Path) -> int:
        """dflash-train in a child process (low priority, bounded threads and cores); its exit code."""
        s = self.settings
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "dflash_core.train", "--target", s.target, "--init-draft", current,
               "--data", str(s.records), "--output", str(out), "--overwrite", "--steps", str(s.steps),
               "--eval-heldout", "--gate-margin", str(s.gate_margin), "--threads", str(s.threads),
               "--device", s.device, "--seed", str(self.cycles), *s.train_args]
        env = {**os.environ, "OMP_NUM_THREADS": str(s.threads), "TQDM_DISABLE": "1"}
        cores = affinity.cores_beside_the_worker()
        with open(out / "train.log", "wb") as logfile, self._child_lock:
            if self._stop.is_set():
                return -1
            # its own session: a signal to the server's group does not reach it; `stop` ends its group
            child = self._child = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True)
        # never ahead of the serving process, and off the worker's core: set from here, before the child has
        # started a thread (later ones inherit both)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, child.pid, NICE)
            if cores:
                os.sched_setaffinity(child.pid, cores)
        try:
            return child.wait()
        finally:
            with self._child_lock:
                self._child = None


def last_cycle(folder: Path) -> int:
    """The highest cycle number in `folder` (0: none)."""
    numbers = [int(p.name.removeprefix("cycle-")) for p in folder.glob("cycle-*") if p.name[6:].isdigit()]
    return max(numbers, default=0)


def _end(child: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the child's process group, SIGKILL after 10 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if child.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(10)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _log_report(r: CycleReport) -> None:
    if r.error is not None and r.old_acceptance_length is None:
        log.error("draft adaptation cycle %d: %s", r.cycle, r.error)
        return
    verdict = (f"swapped in as draft_version {r.draft_version}" if r.promoted else
               r.error or "kept the serving draft (below the gate's margin)")
    log.info("draft adaptation cycle %d: %d records, trained in %.0f s; held-out acceptance length %.2f -> %.2f, "
             "estimated speedup %s -> %s: %s (%s)", r.cycle, r.records, r.train_seconds, r.old_acceptance_length,
             r.new_acceptance_length, _fmt(r.old_estimated_speedup), _fmt(r.new_estimated_speedup), verdict,
             r.output, extra={"event": "draft_adaptation", **asdict(r)})


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def adapt_settings(settings: Settings, target: str) -> AdaptSettings:
    """The cycle's settings from the server's (`--adapt-*`)."""
    records = Path(settings.record_traffic).expanduser()
    folder = Path(settings.adapt_dir).expanduser() if settings.adapt_dir else records / "adapted"
    return AdaptSettings(target=target, records=records, folder=folder, interval_s=settings.adapt_interval,
                         min_records=settings.adapt_min_records, steps=settings.adapt_steps,
                         threads=settings.adapt_threads, device=settings.adapt_device,
                         gate_margin=settings.adapt_gate_margin, train_args=tuple(shlex.split(
                             settings.adapt_train_args or "")))
