"""Prometheus collectors of the server (vLLM semantics, ``dflash_`` prefix, base units; README "Metrics").

The worker thread is the only writer: it calls :meth:`ServerMetrics.observe_step` once per engine
``StepOutput``, :meth:`ServerMetrics.observe_kv` once per step with the engine's ``kv_stats()`` (the KV pool's
usage, prefix-cache queries and hits in tokens, preemptions: cumulative in the engine, turned into counter
increments here), :meth:`ServerMetrics.observe_finished` once per finished request,
:meth:`ServerMetrics.set_queue_state` whenever the queue changes and :meth:`ServerMetrics.maybe_log_summary`
once per iteration. ``GET /metrics`` calls :meth:`ServerMetrics.render` from the event loop. Every value is
observed in exactly one place: spec-decode counters, the acceptance-length histogram and the generation-token
counter per step; everything per request (prompt tokens, latencies, finish reason) once at the end.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dflash_core.speculation import width_set
from dflash_core.stats import mean_acceptance_length

if TYPE_CHECKING:
    from dflash_core.kv.pool import KVStats
    from dflash_core.outputs import StepOutput

# The 0.0.4 text format renders a ``*_created`` gauge next to every counter and histogram series; nothing
# reads them (dashboards use rate/increase) and they double the series count, so they are off.
prometheus_client.disable_created_metrics()

logger = logging.getLogger("dflash.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISHED_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
MODEL_INFO_LABELS = ("target", "draft", "draft_version", "block_size", "device", "backend")

# Latency buckets: vLLM's, extended downwards because speculative decoding commits several tokens per step.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)


def verify_width_buckets(block_size: int, max_width: int) -> list[float]:
    """The chain widths a block size allows, then doublings up to the widest row (a tree's nodes and root)."""
    widths = set(width_set(block_size)) | {max_width}
    w = block_size
    while w < max_width:
        widths.add(w)
        w *= 2
    return [float(w) for w in sorted(widths)]


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets or [1.0]
            buckets.append(float(value))
        exponent += 1


@dataclass
class _DraftSeries:
    """The spec-decode series of one draft version (looked up once, not per step)."""

    drafts: Any
    draft_tokens: Any
    accepted_tokens: Any
    accepted_per_pos: list[Any]
    acceptance_length: Any


class ServerMetrics:
    """All Prometheus collectors of one app, on their own registry, plus the request and summary log lines."""

    def __init__(
        self,
        *,
        block_size: int,
        target: str,
        draft: str,
        device: str,
        backend: str,
        registry: CollectorRegistry | None = None,
        max_model_len: int = 32768,
        max_verify_width: int | None = None,
        log_interval_s: float = 5.0,
        tokens_per_second_window_s: float = 10.0,
    ) -> None:
        """Create the collectors on ``registry`` (a fresh one when None) and publish ``dflash_model_info``."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.registry = registry if registry is not None else CollectorRegistry()
        self.log_interval_s = log_interval_s
        self.window_s = tokens_per_second_window_s
        reg = self.registry

        # Counters (prometheus_client appends the ``_total`` suffix).
        self.requests = Counter(
            "dflash_requests", "Finished requests by finish reason.", ["finished_reason"], registry=reg
        )
        for reason in FINISHED_REASONS:
            self.requests.labels(finished_reason=reason)
        self.prompt_tokens = Counter(
            "dflash_prompt_tokens", "Prompt tokens of finished requests.", registry=reg
        )
        self.generation_tokens = Counter("dflash_generation_tokens", "Generated tokens.", registry=reg)
        # What measures the draft carries its `draft_version` (1: the draft loaded at start, one more per swap):
        # a swapped-in draft's acceptance starts series of its own
        self.num_drafts = Counter(
            "dflash_spec_decode_num_drafts", "Draft blocks verified by the target.", ["draft_version"], registry=reg
        )
        self.num_draft_tokens = Counter(
            "dflash_spec_decode_num_draft_tokens", "Draft tokens proposed.", ["draft_version"], registry=reg
        )
        self.num_accepted_tokens = Counter(
            "dflash_spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", ["draft_version"],
            registry=reg,
        )
        self.accepted_per_pos = Counter(
            "dflash_spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft block (0 = first proposed token).",
            ["position", "draft_version"],
            registry=reg,
        )

        # Histograms.
        self.acceptance_length = Histogram(
            "dflash_acceptance_length",
            "Tokens committed per verify step (accepted draft tokens + 1).",
            ["draft_version"],
            buckets=[float(i) for i in range(1, block_size + 1)],
            registry=reg,
        )
        self.verify_width = Histogram(
            "dflash_spec_decode_verify_width",
            "Tokens each verify row checked (draft tokens + 1; 1 is a plain step), as the width policy chose.",
            buckets=verify_width_buckets(block_size, max_verify_width or block_size),
            registry=reg,
        )
        self.ttft = Histogram(
            "dflash_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "dflash_inter_token_latency_seconds",
            "Interval between chunks divided by the tokens in the chunk, observed once per token.",
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "dflash_e2e_request_latency_seconds",
            "Time from arrival to finish.",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "dflash_request_queue_time_seconds",
            "Time from arrival to admission into the engine.",
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        )
        self.request_generation_tokens = Histogram(
            "dflash_request_generation_tokens",
            "Generated tokens per finished request.",
            buckets=build_1_2_5_buckets(max_model_len),
            registry=reg,
        )

        # KV cache (vLLM's kv_cache_usage_perc, prefix_cache_queries / _hits in tokens, num_preemptions).
        self.kv_cache_usage = Gauge(
            "dflash_kv_cache_usage_perc",
            "KV cache usage: the fraction of the KV pool's blocks held by requests (0..1; 0 without a pool).",
            registry=reg,
        )
        self.prefix_cache_queries = Counter(
            "dflash_prefix_cache_queries",
            "Prefix cache queries, in tokens: prompt tokens looked up in the prefix cache at admission.",
            registry=reg,
        )
        self.prefix_cache_hits = Counter(
            "dflash_prefix_cache_hits",
            "Prefix cache hits, in tokens: prompt tokens whose KV came from the prefix cache.",
            registry=reg,
        )
        self.num_preemptions = Counter(
            "dflash_num_preemptions",
            "Preemptions: running requests that gave their KV blocks back when the pool ran out (recomputed later).",
            registry=reg,
        )

        # Gauges.
        self.running = Gauge("dflash_num_requests_running", "Requests in the engine.", registry=reg)
        self.waiting = Gauge("dflash_num_requests_waiting", "Requests queued for admission.", registry=reg)
        self.tokens_per_second = Gauge(
            "dflash_generation_tokens_per_second",
            f"Generated tokens per second over the last {tokens_per_second_window_s:g} s.",
            registry=reg,
        )
        self.tokens_per_second.set_function(self._window_rate)
        self.estimated_speedup = Gauge(
            "dflash_spec_decode_estimated_speedup",
            "Estimated speedup over plain decoding at the current load: committed tokens per second of recent "
            "steps over what plain steps of the same batch would give (measured step costs; 1 without a draft).",
            registry=reg,
        )
        self.estimated_speedup.set(1.0)
        self.model_info = Gauge(
            "dflash_model_info",
            "Served model pair (value is always 1).",
            MODEL_INFO_LABELS,
            registry=reg,
        )
        self._info = {"target": target, "block_size": str(block_size), "device": device, "backend": backend}
        self._draft: _DraftSeries
        self._info_labels: dict[str, str] | None = None
        self.set_draft(draft, 1)

        # State shared with the scrape thread and the summary line.
        self._lock = threading.Lock()
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._last_now: float | None = None  # clock of the caller
        self._last_mono = 0.0  # time.monotonic() when _last_now was seen
        self._n_running = 0
        self._n_waiting = 0
        self._last_log: float | None = None
        self._interval_tokens = 0
        self._interval_drafts = 0
        self._interval_accepted = 0
        self._kv_seen = (0, 0, 0)  # the engine's cumulative prefix queries, hits and preemptions last observed
        self._kv_usage: float | None = None  # None: no pool (the summary line leaves it out)
        self._interval_queries = 0
        self._interval_hits = 0

    # -- worker-side observations -------------------------------------------------------------------------

    def set_draft(self, draft: str, version: int) -> None:
        """The draft that proposes from now on (its name, and its version: 1 at start, one more per swap):
        ``dflash_model_info`` names it, and the spec-decode series of its version start (at 0)."""
        v = str(version)
        old, self._info_labels = self._info_labels, {**self._info, "draft": draft or "", "draft_version": v}
        self.model_info.labels(**self._info_labels).set(1)
        if old is not None and old != self._info_labels:  # after the new one is up: a scrape always sees one
            self.model_info.remove(*(old[k] for k in MODEL_INFO_LABELS))
        self._draft = _DraftSeries(
            drafts=self.num_drafts.labels(draft_version=v),
            draft_tokens=self.num_draft_tokens.labels(draft_version=v),
            accepted_tokens=self.num_accepted_tokens.labels(draft_version=v),
            accepted_per_pos=[self.accepted_per_pos.labels(position=str(pos), draft_version=v)
                              for pos in range(self.block_size - 1)],
            acceptance_length=self.acceptance_length.labels(draft_version=v),
        )

    def set_queue_state(self, running: int, waiting: int) -> None:
        """Publish the number of running (in the engine) and waiting (queued) requests."""
        self.running.set(running)
        self.waiting.set(waiting)
        with self._lock:
            self._n_running = running
            self._n_waiting = waiting

    def set_estimated_speedup(self, value: float | None) -> None:
        """Publish the engine's speedup estimate (None: not measured yet, the gauge keeps its value)."""
        if value is not None:
            self.estimated_speedup.set(value)

    def observe_kv(self, stats: KVStats | None) -> None:
        """Publish the engine's KV cache snapshot (None: no pool, nothing changes). Its counts are cumulative;
        the counters grow by the difference (an engine whose counts went back, a new one, starts over)."""
        if stats is None:
            return
        self.kv_cache_usage.set(stats.usage)
        seen = (stats.prefix_queries, stats.prefix_hits, stats.preemptions)
        deltas = [cur - old if cur >= old else cur for cur, old in zip(seen, self._kv_seen, strict=True)]
        for counter, delta in zip((self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions), deltas,
                                  strict=True):
            if delta:
                counter.inc(delta)
        with self._lock:
            self._kv_seen = seen
            self._kv_usage = stats.usage
            self._interval_queries += deltas[0]
            self._interval_hits += deltas[1]

    def observe_step(self, out: StepOutput, now: float) -> None:
        """Count one engine ``StepOutput``: tokens, spec-decode counters, acceptance length, verify width."""
        n_new = len(out.new_token_ids)
        if n_new:
            self.generation_tokens.inc(n_new)
        if out.verify_width > 0:
            self.verify_width.observe(out.verify_width)
        drafted = out.num_draft_tokens > 0
        if drafted:
            series = self._draft
            series.drafts.inc()
            series.draft_tokens.inc(out.num_draft_tokens)
            series.accepted_tokens.inc(out.num_accepted_tokens)
            for pos in range(out.num_accepted_tokens):
                series.accepted_per_pos[pos].inc()
            series.acceptance_length.observe(out.acceptance_length)
        with self._lock:
            self._advance_clock(now)
            if n_new:
                self._window.append((now, n_new))
            self._trim_window(now)
            self._interval_tokens += n_new
            if drafted:
                self._interval_drafts += 1
                self._interval_accepted += out.num_accepted_tokens

    def observe_finished(
        self,
        *,
        request_id: str,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        mean_acceptance_length: float,
        queue_time: float,
        ttft: float | None,
        e2e: float,
        inter_token_latencies: list[float],
    ) -> None:
        """Count one finished request and write its log line (times in seconds, from arrival)."""
        if finish_reason not in FINISHED_REASONS:
            raise ValueError(f"unknown finish_reason {finish_reason!r}; expected one of {FINISHED_REASONS}")
        self.requests.labels(finished_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.queue_time.observe(queue_time)
        self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
        for latency in inter_token_latencies:
            self.itl.observe(latency)
        tokens_per_s = generation_tokens / e2e if e2e > 0 else 0.0
        ttft_text = f"{ttft:.3f}" if ttft is not None else "-"
        logger.info(
            "request finished: id=%s prompt_tokens=%d generation_tokens=%d mean_acceptance_length=%.2f "
            "tokens_per_s=%.1f ttft_s=%s e2e_s=%.3f finish_reason=%s",
            request_id, prompt_tokens, generation_tokens, mean_acceptance_length, tokens_per_s, ttft_text,
            e2e, finish_reason,
            extra={
                "event": "request_finished",
                "request_id": request_id,
                "prompt_tokens": prompt_tokens,
                "generation_tokens": generation_tokens,
                "mean_acceptance_length": round(mean_acceptance_length, 4),
                "tokens_per_s": round(tokens_per_s, 2),
                "ttft_s": None if ttft is None else round(ttft, 6),
                "e2e_s": round(e2e, 6),
                "finish_reason": finish_reason,
            },
        )

    def maybe_log_summary(self, now: float) -> bool:
        """Log a throughput summary at most every ``log_interval_s``, only when busy; True when it logged.

        Busy means requests running or waiting, or tokens generated since the last summary (so the last
        interval of a burst is reported once, and an idle server stays silent).
        """
        with self._lock:
            self._advance_clock(now)
            if self._last_log is None:
                self._last_log = now
                return False
            elapsed = now - self._last_log
            if elapsed < self.log_interval_s:
                return False
            busy = self._n_running > 0 or self._n_waiting > 0 or self._interval_tokens > 0
            tokens, drafts, accepted = self._interval_tokens, self._interval_drafts, self._interval_accepted
            running, waiting = self._n_running, self._n_waiting
            usage, queries, hits = self._kv_usage, self._interval_queries, self._interval_hits
            self._last_log = now
            self._interval_tokens = self._interval_drafts = self._interval_accepted = 0
            self._interval_queries = self._interval_hits = 0
        if not busy:
            return False
        throughput = tokens / elapsed if elapsed > 0 else 0.0
        mean_al = mean_acceptance_length(accepted, drafts)
        fields = {
            "event": "summary",
            "generation_tokens_per_s": round(throughput, 2),
            "mean_acceptance_length": round(mean_al, 4),
            "drafts": drafts,
            "running": running,
            "waiting": waiting,
        }
        kv = ""
        if usage is not None:  # as vLLM's line: KV cache usage, and the prefix hit rate of this interval
            hit_rate = hits / queries if queries else 0.0
            kv = f" kv_cache_usage={usage:.1%} prefix_cache_hit_rate={hit_rate:.1%}"
            fields.update(kv_cache_usage=round(usage, 4), prefix_cache_hit_rate=round(hit_rate, 4))
        logger.info(
            "summary: generation_throughput=%.1f tokens/s mean_acceptance_length=%.2f drafts=%d "
            "running=%d waiting=%d%s",
            throughput, mean_al, drafts, running, waiting, kv,
            extra=fields,
        )
        return True

    # -- scrape side --------------------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """Body and content type for ``GET /metrics`` (Prometheus text format 0.0.4)."""
        return prometheus_client.generate_latest(self.registry), CONTENT_TYPE

    # -- internals ----------------------------------------------------------------------------------------

    def _advance_clock(self, now: float) -> None:
        """Remember the caller's clock against ``time.monotonic()`` (caller holds the lock)."""
        self._last_now = now
        self._last_mono = time.monotonic()

    def _trim_window(self, now: float) -> None:
        """Drop token events older than the window (caller holds the lock)."""
        cutoff = now - self.window_s
        while self._window and self._window[0][0] <= cutoff:
            self._window.popleft()

    def _window_rate(self) -> float:
        """Tokens generated in the last ``window_s`` seconds divided by ``window_s`` (runs at scrape time).

        The worker's clock may be any seconds clock, so "now" is its last value advanced by the monotonic
        time since; the gauge therefore decays to 0 while the server is idle.
        """
        with self._lock:
            if self._last_now is None:
                return 0.0
            now = self._last_now + (time.monotonic() - self._last_mono)
            self._trim_window(now)
            return sum(n for _, n in self._window) / self.window_s
