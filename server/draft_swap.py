"""Replacing the serving draft without a restart: ``POST /v1/admin/draft``, SIGHUP and ``--adapt-draft`` all come
here (``DraftSwapper.swap``).

The folder is read and checked on the calling thread (never the worker's: reading weights takes time), with the
start-up checks against the target; then the worker copies the weights in between two steps
(``Engine.swap_draft``): running requests rebuild their caches and go on, token for token, and the metrics'
``draft_version`` moves on by one. One swap at a time; a failure leaves the old draft serving and says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash_core.draft import DFlashDraft
from dflash_core.draft_formats import read_draft_config
from dflash_core.loading import check_pair

if TYPE_CHECKING:
    from dflash_core.loading import LoadedModels
    from server.metrics import ServerMetrics
    from server.worker import Worker

log = logging.getLogger("dflash.draft_swap")

SWAP_TIMEOUT_S = 300.0  # the worker takes a swap at its next step boundary: milliseconds, unless it is stuck


class DraftSwapError(Exception):
    """A swap that did not happen (the old draft serves on): why, and the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SwapResult:
    """A swap that happened."""

    draft: str  # the folder now serving
    draft_version: int
    restarted_requests: int  # requests that rebuilt their caches to go on with the new draft
    load_seconds: float  # reading and checking the folder (serving went on meanwhile)
    swap_seconds: float  # from the hand-over to the worker until the new draft served


class DraftSwapper:
    """Swaps the draft of one server's engine; thread-safe (one swap at a time)."""

    def __init__(self, models: LoadedModels, worker: Worker, metrics: ServerMetrics,
                 display: Callable[[str], str]) -> None:
        """`display`: a folder's name in the metrics (``server.state.display_name``)."""
        self._models, self._worker, self._metrics, self._display = models, worker, metrics, display
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The serving draft's version (the engine's count: 1 at start, one more per swap)."""
        return self._models.engine.draft_version

    @property
    def current(self) -> str | None:
        """The folder of the serving draft (None: no draft)."""
        return self._models.draft_name

    def swap(self, folder: str | None = None) -> SwapResult:
        """Serve with the draft in `folder` (None: read the serving folder again, as SIGHUP does); DraftSwapError
        when it cannot be."""
        if self._models.engine.drafter is None or self.current is None:
            raise DraftSwapError("this server runs without a draft (--no-speculative): there is none to replace",
                                 409)
        if not self._lock.acquire(blocking=False):
            raise DraftSwapError("another draft swap is in progress; try again when it has finished", 409)
        try:
            return self._swap(folder or self.current)
        finally:
            self._lock.release()

    def _swap(self, folder: str) -> SwapResult:
        t0 = time.perf_counter()
        draft = self._load(folder)
        loaded = time.perf_counter()
        engine, name = self._models.engine, self._display(folder)
        before = engine.draft_version  # one swap at a time: only this one can move it on

        def swap_in() -> int:  # on the worker thread, between two steps
            try:
                return engine.swap_draft(draft)
            finally:
                if engine.draft_version != before:  # the new weights serve, even if the restarts failed
                    self._metrics.set_draft(name, engine.draft_version)

        done = self._worker.between_steps(swap_in)
        try:
            done.result(SWAP_TIMEOUT_S)
        except FutureTimeout:
            if done.cancel():  # the worker never took it: nothing changed
                raise DraftSwapError(f"the worker did not take the new draft within {SWAP_TIMEOUT_S:.0f} s",
                                     503) from None
        except CancelledError:
            raise DraftSwapError("the server is shutting down: the draft was not swapped", 503) from None
        except Exception:
            pass  # `_outcome` says what it was
        restarted = self._outcome(done, folder, before)  # taken by the worker: done, or finishing now
        result = SwapResult(folder, engine.draft_version, restarted, loaded - t0, time.perf_counter() - loaded)
        log.info("draft swapped: %s is draft_version %d (loaded in %.2f s, swapped in %.3f s, %d request(s) "
                 "restarted)", folder, result.draft_version, result.load_seconds, result.swap_seconds, restarted)
        return result

    def _outcome(self, done: Future[int], folder: str, before: int) -> int:
        """The requests the swap restarted; DraftSwapError when it failed (what changed, said). `before`: the
        version before the swap."""
        try:
            restarted = done.result()
        except ValueError as exc:  # the engine refused it (another shape): nothing changed
            raise DraftSwapError(f"the draft at {folder} cannot replace the serving one: {exc}") from None
        except Exception as exc:
            log.exception("draft swap failed")
            if self.version != before:  # the weights were copied in: they serve
                self._models.draft_name = folder
                raise DraftSwapError(f"the draft at {folder} serves (draft_version {self.version}), but restarting "
                                     f"the running requests failed: {type(exc).__name__}: {exc}", 500) from None
            raise DraftSwapError(f"the draft swap failed: {type(exc).__name__}: {exc}", 500) from None
        self._models.draft_name = folder
        return restarted

    def _load(self, folder: str) -> DFlashDraft:
        """The draft in `folder`, checked against the target as at start-up, on the CPU (the worker copies it)."""
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise DraftSwapError(f"no draft folder at {folder}")
        try:
            check_pair(read_draft_config(path), self._models.engine.target)
            return DFlashDraft.from_folder(path, dtype=getattr(torch, self._models.dtype))
        except Exception as exc:  # a missing file, a bad config, weights of other shapes, a corrupt file
            raise DraftSwapError(f"cannot load the draft at {folder}: {' '.join(str(exc).split())}") from None

