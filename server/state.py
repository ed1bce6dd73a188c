"""What the routes share (``ServerState``): settings, the loaded models, the worker, the metrics; loading the models
and starting to serve them (``install``); ``display_name``, a model's name for clients and metrics.

Its own module so that imports run one way: ``server.app`` imports the route modules (``server.checks``,
``server.tokenize_routes``), and they import this, never ``server.app``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_core.config import EngineConfig
from dflash_core.detokenize import TokenStrings
from dflash_core.loading import DEMO_DRAFT, DEMO_TARGET, LoadedModels, load_models
from dflash_core.memory import parse_bytes
from dflash_core.overlap import pays_to_hold
from server import affinity
from server.adapt import DraftAdapter, adapt_settings
from server.chat_setup import ChatSetup
from server.draft_swap import DraftSwapError, DraftSwapper
from server.generation_config import GenerationDefaults, load_generation_defaults
from server.handoff import poll_interval
from server.metrics import ServerMetrics
from server.parsing import Limiter, ParsePool
from server.prompts import PromptBuilder
from server.protocol import now_ts
from server.runs import tokenize_limiter
from server.settings import Settings
from server.traffic import TrafficRecorder
from server.worker import Worker

log = logging.getLogger("dflash.server")


@dataclass
class ServerState:
    """What the routes share: settings, the loaded models, the worker, the metrics."""

    settings: Settings
    models: LoadedModels | None = None
    worker: Worker | None = None
    metrics: ServerMetrics | None = None
    token_strings: TokenStrings | None = None
    prompts: PromptBuilder | None = None
    chat_setup: ChatSetup | None = None
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    served_model_name: str = ""
    load_error: str | None = None
    parser: ParsePool = field(default_factory=ParsePool)
    tokenize_limiter: Limiter = field(default_factory=tokenize_limiter)
    draining: bool = False  # set on SIGTERM (server.__main__): new requests get 503, /health 503
    recorder: TrafficRecorder | None = None  # --record-traffic
    swapper: DraftSwapper | None = None  # replaces the draft while serving (POST /v1/admin/draft, SIGHUP)
    adapter: DraftAdapter | None = None  # --adapt-draft
    loop: asyncio.AbstractEventLoop | None = None  # the event loop serving the app (set by its lifespan)
    created: int = field(default_factory=now_ts)

    @property
    def ready(self) -> bool:
        """Models loaded, warmed up, and the worker running."""
        return self.worker is not None and self.worker.ready

    def install(
        self, models: LoadedModels, warm_up: bool = False, on_error: Callable[[str], None] | None = None
    ) -> None:
        """Start serving ``models``: metrics, worker thread. With ``warm_up`` the worker first runs
        ``Engine.warm_up`` on its own thread (the runners' compiled shapes, then the cost measurements: cold first
        forwards must not reach the width policy), and is not ready before it has; a failure is a load error."""
        s = self.settings
        self.served_model_name = s.served_model_name or display_name(models.target_name)
        self.metrics = ServerMetrics(
            block_size=models.block_size,
            target=display_name(models.target_name),
            draft=display_name(models.draft_name),
            device=models.device,
            backend=models.backend,
            max_model_len=models.engine.max_model_len,
            max_verify_width=models.engine.max_verify_width,
        )
        self.chat_setup = ChatSetup(
            models.tokenizer, s.reasoning_parser, s.tool_call_parser, s.enable_auto_tool_choice, models.engine.grammar,
            compile_timeout=s.grammar_compile_timeout,
        )
        self.generation_defaults = load_generation_defaults(s.generation_config, models.target_name)
        self.token_strings = TokenStrings(models.tokenizer)
        self.prompts = PromptBuilder(
            models.tokenizer,
            models.engine.max_model_len,
            allow_special_tokens=s.allow_special_tokens,
            chat_template=s.chat_template_text(),
            trust_request_chat_template=s.trust_request_chat_template,
        )
        if s.record_traffic is not None:
            self.recorder = TrafficRecorder(s.record_traffic, parse_bytes(s.record_max_bytes))
            log.warning("recording traffic (prompts and outputs: user content) to %s", self.recorder.folder)
        worker = Worker(
            models.engine,
            models.tokenizer,
            self.metrics,
            max_running=s.max_running_requests,
            max_waiting=s.max_waiting_requests,
            warm_up=models.engine.warm_up if warm_up else None,
            on_warm_up_error=lambda exc: self._failed(exc, on_error),
            on_ready=self._one_core if self._wants_one_core(models) else None,
            recorder=self.recorder, model_name=self.served_model_name,
            hold_events=pays_to_hold(models.device, models.cpu_step), poll_events_s=poll_interval(models.device),
        )
        worker.start()
        self.swapper = DraftSwapper(models, worker, self.metrics, display_name)
        if s.adapt_draft and models.draft_name is not None:
            self.adapter = DraftAdapter(adapt_settings(s, models.target_name), self.swapper)
            self.adapter.start()
        self.models = models
        self.worker = worker
        # Everything loaded so far lives as long as the server: out of the collector's sight, so that a full
        # collection no longer walks it (tens of ms each time, a stall for every running stream).
        gc.collect()
        gc.freeze()
        log.info(
            "serving %s as %r (draft %s, block size %d, device %s, dtype %s%s, max model len %d)",
            models.target_name,
            self.served_model_name,
            models.draft_name or "none (autoregressive)",
            models.block_size,
            models.device,
            models.dtype,
            f", target linear weights {models.quantization}" if models.quantization else "",
            models.engine.max_model_len,
        )

    def _wants_one_core(self, models: LoadedModels) -> bool:
        """``--one-core``, or its default (`affinity.default_on`); only where the event loop is known
        (not in a Ray replica) and thread affinity can be set."""
        import torch

        wanted = self.settings.one_core
        if wanted is None:
            wanted = affinity.default_on(models.device, torch.get_num_threads(), models.cpu_step)
        if not wanted:
            return False
        why = "the event loop is not known here" if self.loop is None else (
            None if affinity.supported() else "thread affinity needs Linux and more than one core")
        if why is not None and self.settings.one_core:
            log.warning("--one-core ignored: %s", why)
        return why is None

    def _one_core(self) -> None:
        """On the worker thread, after warm-up: it, then the event loop's thread (which pins itself), on one
        core."""
        assert self.loop is not None
        core = affinity.choose_core()
        affinity.pin_current_thread(core)
        try:
            self.loop.call_soon_threadsafe(affinity.pin_current_thread, core)
        except RuntimeError:  # the loop has closed: nothing to serve
            return
        log.info("event loop and worker thread on core %d (--one-core; --no-one-core leaves them free)", core)

    def load(self, on_error: Callable[[str], None] | None) -> None:
        """Load the models (background thread), then start serving."""
        s = self.settings
        if s.speculative and s.draft is None and s.target is not None:
            log.warning("no draft model given: serving the target autoregressively")
        try:
            # without --speculative: no draft; the runners warm up on the worker thread (Engine.warm_up)
            models = load_models(EngineConfig.from_settings(s), warm_up=False)
            self.install(models, warm_up=True, on_error=on_error)
        except Exception as e:
            self._failed(e, on_error)

    def reload_draft(self, folder: str | None = None) -> None:
        """SIGHUP: swap in the draft in `folder` (None: the serving folder, read again), the outcome logged; never
        raises (a failure leaves the old draft serving)."""
        if self.swapper is None or not self.ready:
            log.warning("draft reload ignored: the server is not serving yet")
            return
        try:
            self.swapper.swap(folder)
        except DraftSwapError as exc:
            log.error("draft reload failed, the old draft serves on: %s", exc)

    def _failed(self, e: Exception, on_error: Callable[[str], None] | None) -> None:
        """Loading or warming up failed: /health says why, in one line."""
        self.load_error = " ".join(f"{type(e).__name__}: {e}".split())  # one line
        # one clear line; the traceback only with --log-level debug
        log.error("loading the models failed: %s", self.load_error, exc_info=log.isEnabledFor(logging.DEBUG))
        if on_error is not None:
            on_error(self.load_error)


def display_name(name: str | None) -> str:
    """A model's name for metrics and /v1/models (and the default API name): the folder's name, not its path,
    ``dflash-demo`` for the demo models, or the hub id."""
    if not name:
        return ""
    path = Path(name).expanduser()
    if not path.exists():  # a hub id ("org/name"), or a path that has gone: its last part
        return path.name if name.startswith(("/", ".", "~")) or name.count("/") > 1 else name
    resolved = path.resolve()
    if resolved == DEMO_TARGET.resolve():
        return "dflash-demo"
    if resolved == DEMO_DRAFT.resolve():
        return "dflash-demo-draft"
    return resolved.name
