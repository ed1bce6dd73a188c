"""Unit tests of server.metrics.ServerMetrics: parse the rendered exposition and lint it with promtool."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dflash_core.outputs import StepOutput
from server.logs import setup_logging
from server.metrics import ServerMetrics

B = 4  # block size of the synthetic engine


def prefill(rid: int) -> StepOutput:
    """The step that ran the prompt and produced the first token."""
    return StepOutput(rid, [7], None, None, 0, 0, 0, True, None)


def verify(rid: int, accepted: int, finish: str | None = None, cut: int | None = None) -> StepOutput:
    """A draft+verify step that accepted ``accepted`` draft tokens (cut to ``cut`` tokens by a stop)."""
    n = accepted + 1 if cut is None else cut
    return StepOutput(rid, list(range(n)), finish, None, accepted + 1, B - 1, accepted, False, None, verify_width=B)


def make_metrics(**kwargs: Any) -> ServerMetrics:
    """A ServerMetrics on its own registry."""
    return ServerMetrics(
        block_size=B, target="tiny-target", draft="tiny-draft", device="cpu", backend="hf",
        registry=CollectorRegistry(), **kwargs,
    )


def samples(m: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse the rendered text: {(sample name, sorted labels): value}."""
    body, content_type = m.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(parsed: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """One sample's value."""
    return parsed[(name, tuple(sorted(labels.items())))]


def families(m: ServerMetrics) -> dict[str, str]:
    """Metric family name -> type, as parsed from the rendered text."""
    body, _ = m.render()
    return {f.name: f.type for f in text_string_to_metric_families(body.decode())}


def finish(m: ServerMetrics, rid: str, reason: str, gen: int, itl: list[float] | None = None) -> None:
    """Report one finished request with fixed latencies."""
    m.observe_finished(
        request_id=rid, finish_reason=reason, prompt_tokens=5, generation_tokens=gen,
        mean_acceptance_length=2.0, queue_time=0.002, ttft=0.05, e2e=0.5,
        inter_token_latencies=itl if itl is not None else [0.01] * (gen - 1),
    )


def test_names_types_labels_and_buckets() -> None:
    """Exactly the families, types, labels and buckets docs/metrics.md lists, present before traffic."""
    m = make_metrics()
    assert families(m) == {
        "dflash_requests": "counter",
        "dflash_prompt_tokens": "counter",
        "dflash_generation_tokens": "counter",
        "dflash_spec_decode_num_drafts": "counter",
        "dflash_spec_decode_num_draft_tokens": "counter",
        "dflash_spec_decode_num_accepted_tokens": "counter",
        "dflash_spec_decode_num_accepted_tokens_per_pos": "counter",
        "dflash_acceptance_length": "histogram",
        "dflash_spec_decode_verify_width": "histogram",
        "dflash_time_to_first_token_seconds": "histogram",
        "dflash_inter_token_latency_seconds": "histogram",
        "dflash_e2e_request_latency_seconds": "histogram",
        "dflash_request_queue_time_seconds": "histogram",
        "dflash_request_generation_tokens": "histogram",
        "dflash_num_requests_running": "gauge",
        "dflash_num_requests_waiting": "gauge",
        "dflash_generation_tokens_per_second": "gauge",
        "dflash_spec_decode_estimated_speedup": "gauge",
        "dflash_model_info": "gauge",
        "dflash_kv_cache_usage_perc": "gauge",
        "dflash_prefix_cache_queries": "counter",
        "dflash_prefix_cache_hits": "counter",
        "dflash_num_preemptions": "counter",
    }
    parsed = samples(m)
    names = {name for name, _ in parsed}
    assert "dflash_requests_total" in names and not any(n.endswith("_created") for n in names)
    for reason in ("stop", "length", "abort", "error"):
        assert value(parsed, "dflash_requests_total", finished_reason=reason) == 0
    for pos in range(B - 1):
        assert value(parsed, "dflash_spec_decode_num_accepted_tokens_per_pos_total", position=str(pos),
                     draft_version="1") == 0
    per_pos_last = ("dflash_spec_decode_num_accepted_tokens_per_pos_total", (("draft_version", "1"),
                                                                              ("position", str(B - 1))))
    assert per_pos_last not in parsed
    les = sorted(
        float(dict(labels)["le"]) for name, labels in parsed if name == "dflash_acceptance_length_bucket"
    )
    assert les == [1.0, 2.0, 3.0, 4.0, math.inf]
    widths = sorted(
        float(dict(labels)["le"]) for name, labels in parsed if name == "dflash_spec_decode_verify_width_bucket"
    )
    assert widths == [1.0, 2.0, 4.0, math.inf]  # the width set of a block of B = 4
    assert value(parsed, "dflash_spec_decode_estimated_speedup") == 1.0
    info = value(
        parsed, "dflash_model_info", target="tiny-target", draft="tiny-draft", block_size=str(B),
        device="cpu", backend="hf", draft_version="1",
    )
    assert info == 1


def test_step_and_request_accounting() -> None:
    """Counters and histograms after synthetic traffic: drafts, per-position, ITL count, finish reasons."""
    m = make_metrics()
    m.set_queue_state(running=2, waiting=1)
    now = 100.0
    # Request 1: prefill, accepts 3, 0, 2 (then length).
    # Request 2: prefill, accepts 1, then a stop cuts that block to 1 token.
    steps = [prefill(1), prefill(2), verify(1, 3), verify(2, 1, finish="stop", cut=1), verify(1, 0),
             verify(1, 2, finish="length")]
    for out in steps:
        now += 0.01
        m.observe_step(out, now)
    gen1 = 1 + 4 + 1 + 3
    gen2 = 1 + 1
    finish(m, "r1", "length", gen1)
    finish(m, "r2", "stop", gen2)
    m.set_queue_state(running=0, waiting=0)

    p = samples(m)
    assert value(p, "dflash_generation_tokens_total") == gen1 + gen2
    assert value(p, "dflash_prompt_tokens_total") == 10
    assert value(p, "dflash_spec_decode_num_drafts_total", draft_version="1") == 4
    assert value(p, "dflash_spec_decode_num_draft_tokens_total", draft_version="1") == 4 * (B - 1)
    accepted = 3 + 1 + 0 + 2
    assert value(p, "dflash_spec_decode_num_accepted_tokens_total", draft_version="1") == accepted
    per_pos_name = "dflash_spec_decode_num_accepted_tokens_per_pos_total"
    per_pos = [value(p, per_pos_name, position=str(k), draft_version="1") for k in range(3)]
    assert per_pos == [3, 2, 1]  # positions reached by accepts of 3, 1, 0, 2
    assert sum(per_pos) == accepted
    assert max(per_pos) <= value(p, "dflash_spec_decode_num_drafts_total", draft_version="1")
    # Acceptance length: one observation per verify step, a+1 before the stop cut; never for prefill.
    assert value(p, "dflash_acceptance_length_count", draft_version="1") == 4
    assert value(p, "dflash_spec_decode_verify_width_count") == 4  # every verify step, at width B
    assert value(p, "dflash_spec_decode_verify_width_bucket", le="2.0") == 0
    assert value(p, "dflash_acceptance_length_sum", draft_version="1") == 4 + accepted
    assert value(p, "dflash_acceptance_length_bucket", le="1.0", draft_version="1") == 1
    assert value(p, "dflash_acceptance_length_bucket", le="2.0", draft_version="1") == 2
    assert value(p, "dflash_acceptance_length_bucket", le="4.0", draft_version="1") == 4
    mean_al = 1 + value(p, "dflash_spec_decode_num_accepted_tokens_total", draft_version="1") / value(
        p, "dflash_spec_decode_num_drafts_total", draft_version="1"
    )
    assert mean_al == pytest.approx(1 + 6 / 4)
    # Per-request histograms: one observation per request; ITL one per token after the first.
    for name in ("dflash_time_to_first_token_seconds", "dflash_e2e_request_latency_seconds",
                 "dflash_request_queue_time_seconds", "dflash_request_generation_tokens"):
        assert value(p, f"{name}_count") == 2, name
    assert value(p, "dflash_request_generation_tokens_sum") == gen1 + gen2
    assert value(p, "dflash_inter_token_latency_seconds_count") == gen1 + gen2 - 2
    assert value(p, "dflash_inter_token_latency_seconds_sum") == pytest.approx(0.01 * (gen1 + gen2 - 2))
    assert value(p, "dflash_requests_total", finished_reason="length") == 1
    assert value(p, "dflash_requests_total", finished_reason="stop") == 1
    assert value(p, "dflash_requests_total", finished_reason="abort") == 0
    assert value(p, "dflash_num_requests_running") == 0
    assert value(p, "dflash_num_requests_waiting") == 0


def test_autoregressive_and_abort() -> None:
    """block_size 1 (plain AR): no draft counters move, no per-position series; an abort is counted."""
    m = ServerMetrics(block_size=1, target="t", draft="", device="cpu", backend="hf")
    m.observe_step(StepOutput(0, [1], None, None, 0, 0, 0, True, None), 1.0)
    m.observe_step(StepOutput(0, [2], "length", None, 1, 0, 0, False, None), 1.1)
    m.observe_step(StepOutput(1, [], "abort", None, 0, 0, 0, False, None), 1.2)
    m.observe_finished(
        request_id="a", finish_reason="abort", prompt_tokens=3, generation_tokens=0,
        mean_acceptance_length=1.0, queue_time=0.1, ttft=None, e2e=0.2, inter_token_latencies=[],
    )
    p = samples(m)
    assert value(p, "dflash_generation_tokens_total") == 2
    assert value(p, "dflash_spec_decode_num_drafts_total", draft_version="1") == 0
    assert value(p, "dflash_acceptance_length_count", draft_version="1") == 0
    assert not any(name.endswith("_per_pos_total") for name, _ in p)
    assert value(p, "dflash_requests_total", finished_reason="abort") == 1
    assert value(p, "dflash_time_to_first_token_seconds_count") == 0
    assert value(p, "dflash_e2e_request_latency_seconds_count") == 1
    with pytest.raises(ValueError, match="finish_reason"):
        m.observe_finished(
            request_id="b", finish_reason="eos", prompt_tokens=1, generation_tokens=1,
            mean_acceptance_length=1.0, queue_time=0.0, ttft=0.1, e2e=0.1, inter_token_latencies=[],
        )


def test_registries_are_independent() -> None:
    """Two apps in one process (as in the tests) do not share or clash on collectors."""
    a, b = make_metrics(), make_metrics()
    a.observe_step(verify(0, 2), 1.0)
    assert value(samples(a), "dflash_spec_decode_num_drafts_total", draft_version="1") == 1
    assert value(samples(b), "dflash_spec_decode_num_drafts_total", draft_version="1") == 0


def test_tokens_per_second_window() -> None:
    """The throughput gauge counts the last window only and decays to 0 when the worker goes quiet."""
    m = make_metrics(tokens_per_second_window_s=10.0)
    assert value(samples(m), "dflash_generation_tokens_per_second") == 0
    m.observe_step(verify(0, 3), now=1000.0)  # 4 tokens, falls out of the window below
    for i in range(10):
        m.observe_step(verify(0, 1), now=1011.0 + i * 0.1)  # 2 tokens each
    assert value(samples(m), "dflash_generation_tokens_per_second") == pytest.approx(20 / 10.0)
    m2 = make_metrics(tokens_per_second_window_s=0.05)
    m2.observe_step(verify(0, 3), now=5.0)
    assert value(samples(m2), "dflash_generation_tokens_per_second") == pytest.approx(4 / 0.05)
    decayed = False
    t_end = time.monotonic() + 2.0
    while not decayed and time.monotonic() < t_end:  # bounded: the window is 50 ms
        time.sleep(0.02)
        decayed = value(samples(m2), "dflash_generation_tokens_per_second") == 0
    assert decayed


def test_request_log_line_and_summary(caplog: pytest.LogCaptureFixture) -> None:
    """One log line per finished request with its fields; summaries at most every interval, only when busy."""
    m = make_metrics(log_interval_s=5.0)
    caplog.set_level(logging.INFO, logger="dflash.metrics")
    m.observe_finished(
        request_id="cmpl-42", finish_reason="length", prompt_tokens=12, generation_tokens=30,
        mean_acceptance_length=3.25, queue_time=0.01, ttft=0.2, e2e=1.5, inter_token_latencies=[0.05] * 29,
    )
    (rec,) = [r for r in caplog.records if getattr(r, "event", None) == "request_finished"]
    text = rec.getMessage()
    for part in ("id=cmpl-42", "prompt_tokens=12", "generation_tokens=30", "mean_acceptance_length=3.25",
                 "tokens_per_s=20.0", "ttft_s=0.200", "finish_reason=length"):
        assert part in text
    caplog.clear()

    assert m.maybe_log_summary(0.0) is False  # first call only starts the interval
    assert m.maybe_log_summary(10.0) is False  # idle: nothing running, waiting or generated
    m.set_queue_state(running=1, waiting=2)
    m.observe_step(verify(0, 3), 11.0)
    m.observe_step(verify(0, 1), 12.0)
    assert m.maybe_log_summary(12.0) is False  # under the interval
    assert m.maybe_log_summary(15.0) is True
    (rec,) = [r for r in caplog.records if getattr(r, "event", None) == "summary"]
    assert rec.running == 1 and rec.waiting == 2  # type: ignore[attr-defined]
    assert rec.mean_acceptance_length == pytest.approx(1 + 4 / 2)  # type: ignore[attr-defined]
    assert rec.generation_tokens_per_s == pytest.approx(6 / 5.0)  # type: ignore[attr-defined]
    assert "running=1 waiting=2" in rec.getMessage()
    m.set_queue_state(running=0, waiting=0)
    caplog.clear()
    assert m.maybe_log_summary(100.0) is False  # idle again: silent
    assert not caplog.records


def test_setup_logging_json() -> None:
    """JSON logging writes one object per line including the request fields; a second call replaces it."""
    stream = io.StringIO()
    root = logging.getLogger()
    old_handlers, old_level = list(root.handlers), root.level
    try:
        setup_logging("info", json_format=True, stream=stream)
        setup_logging("info", json_format=True, stream=stream)  # idempotent: one handler, one line per record
        finish(make_metrics(), "cmpl-7", "stop", 3)
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
        (line,) = [x for x in lines if x.get("event") == "request_finished"]
        assert line["request_id"] == "cmpl-7" and line["finish_reason"] == "stop" and line["level"] == "INFO"
        assert line["generation_tokens"] == 3 and line["logger"] == "dflash.metrics"
        with pytest.raises(ValueError):
            setup_logging("loud", json_format=False)
    finally:
        for h in list(root.handlers):
            if h not in old_handlers:
                root.removeHandler(h)
        root.setLevel(old_level)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool absent (Debian package prometheus)")
def test_promtool_check_metrics() -> None:
    """`promtool check metrics` finds no problem in the exposition, before and after traffic."""
    m = make_metrics()
    for body in (m.render()[0], None):
        if body is None:
            m.set_queue_state(1, 0)
            m.observe_step(prefill(0), 1.0)
            m.observe_step(verify(0, 2, finish="stop"), 1.1)
            finish(m, "x", "stop", 4)
            body = m.render()[0]
        proc = subprocess.run(
            ["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30, check=False
        )
        assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
            proc.stdout.decode() + proc.stderr.decode()
        )


DOCKER = Path(__file__).resolve().parent.parent / "docker"
KV_SERIES = ("dflash_kv_cache_usage_perc", "dflash_prefix_cache_queries_total", "dflash_prefix_cache_hits_total",
             "dflash_num_preemptions_total")


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the Grafana dashboard, Grafana variables replaced by concrete values."""
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "dflash-serve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    subs = {"$__rate_interval": "1m", "$job": ".*", "$instance": ".*"}
    for var, val in subs.items():
        exprs = [e.replace(var, val) for e in exprs]
    return exprs


def test_dashboard_uses_only_exported_metrics() -> None:
    """The dashboard reads only series that ServerMetrics exports (catches renames on either side)."""
    body = make_metrics().render()[0].decode()
    exported = {s.name for f in text_string_to_metric_families(body) for s in f.samples}
    used = {n for e in dashboard_exprs() for n in re.findall(r"\bdflash_[a-z0-9_]+", e)}
    assert used and used <= exported, used - exported
    assert set(KV_SERIES) <= used  # KV usage, prefix hit rate and preemptions have panels


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool absent (Debian package prometheus)")
def test_dashboard_promql_and_prometheus_config(tmp_path: Path) -> None:
    """promtool parses every dashboard expression (as recording rules) and the compose scrape config."""
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": e} for i, e in enumerate(dashboard_exprs())]}]}
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules))
    for args in (["check", "rules", str(rules_file)], ["check", "config", str(DOCKER / "prometheus.yml")]):
        proc = subprocess.run(["promtool", *args], capture_output=True, timeout=30, check=False)
        assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()


# --- the KV cache: vLLM's kv_cache_usage_perc, prefix_cache_queries / hits (tokens), num_preemptions ------------


def kv(usage: float, queries: int, hits: int, preemptions: int) -> Any:
    from dflash_core.kv.pool import KVStats

    return KVStats(num_blocks=64, block_size=16, usage=usage, prefix_queries=queries, prefix_hits=hits,
                   preemptions=preemptions)


def test_kv_cache_metrics_follow_the_engines_cumulative_counts(caplog: pytest.LogCaptureFixture) -> None:
    m = make_metrics(log_interval_s=1.0)
    parsed = samples(m)
    assert [value(parsed, n) for n in KV_SERIES] == [0, 0, 0, 0]  # present before traffic
    m.observe_kv(None)  # no pool (hf backend): nothing moves
    m.observe_kv(kv(0.25, 1000, 0, 0))
    m.observe_kv(kv(0.5, 2600, 1536, 1))
    parsed = samples(m)
    assert [value(parsed, n) for n in KV_SERIES] == [0.5, 2600, 1536, 1]
    m.observe_kv(kv(0.125, 2600, 1536, 1))  # an unchanged count adds nothing
    m.observe_kv(None)
    assert [value(samples(m), n) for n in KV_SERIES] == [0.125, 2600, 1536, 1]
    with caplog.at_level(logging.INFO, logger="dflash.metrics"):
        m.set_queue_state(running=1, waiting=0)
        m.maybe_log_summary(0.0)
        m.observe_kv(kv(0.75, 3600, 2304, 3))
        m.maybe_log_summary(2.0)  # the first summary: everything since start, 2,304 of 3,600 tokens hit
    line = next(r for r in caplog.records if r.getMessage().startswith("summary:"))
    assert "kv_cache_usage=75.0% prefix_cache_hit_rate=64.0%" in line.getMessage()
    assert line.kv_cache_usage == 0.75 and line.prefix_cache_hit_rate == 0.64  # type: ignore[attr-defined]
    assert value(samples(m), "dflash_num_preemptions_total") == 3


def test_kv_metrics_and_cached_tokens_through_the_app() -> None:
    """A fake engine with a KV pool: /metrics shows its snapshot after a step, and responses carry OpenAI's
    usage.prompt_tokens_details.cached_tokens (chat and completions, streamed and not; once per prompt)."""
    from tests.fake_engine import FakeEngine, Script, demo_tokenizer
    from tests.test_app_fake import chat, completion, make_app, run, serving, stream_chunks

    class PagedFakeEngine(FakeEngine):
        """Scripted prefix-cache hits per prompt key, and a scripted KV snapshot."""

        hits: dict[str, list[int]]
        snapshot: Any = None

        def add_request(self, prompt_token_ids: list[int], params: Any) -> int:
            rid = super().add_request(prompt_token_ids, params)
            key = next((k for k in self.hits if k in self.prompts[rid]), None)
            if key is not None and self.hits[key]:
                self.stats(rid).cached_tokens = self.hits[key].pop(0)
            return rid

        def kv_stats(self) -> Any:
            return self.snapshot

    engine = PagedFakeEngine(tokenizer=demo_tokenizer())
    engine.hits = {"turn": [0, 48, 48, 32, 48, 16, 16]}
    engine.snapshot = kv(0.375, 96, 48, 2)
    engine.script("turn", Script(["ok"]))
    app = make_app(engine)

    def cached(body: dict[str, Any]) -> int:
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def test() -> None:
        async with serving(app) as client:
            r = await client.post("/v1/chat/completions", json=chat("turn one"))
            assert cached(r.json()) == 0 and r.json()["usage"]["prompt_tokens"] > 0
            r = await client.post("/v1/chat/completions", json=chat("turn two"))
            assert cached(r.json()) == 48
            r = await client.post("/v1/completions", json=completion("turn three", stream=True,
                                                                     stream_options={"include_usage": True}))
            assert cached(stream_chunks(r.text)[-1]) == 48
            # two prompts x n=2: each prompt counts once, with the least any of its choices got (32, then 16)
            r = await client.post("/v1/completions", json=completion(["turn a", "turn b"], n=2))
            assert cached(r.json()) == 32 + 16
            metrics = (await client.get("/metrics")).text
            assert "dflash_kv_cache_usage_perc 0.375" in metrics
            assert "dflash_prefix_cache_queries_total 96.0" in metrics
            assert "dflash_prefix_cache_hits_total 48.0" in metrics
            assert "dflash_num_preemptions_total 2.0" in metrics

    run(test)


def test_a_swapped_draft_counts_under_its_own_version() -> None:
    """After a draft swap (`set_draft`) the spec-decode series of the new version grow, the old ones stay, and
    dflash_model_info names the new draft only."""
    m = make_metrics()
    m.observe_step(verify(1, accepted=2), now=1.0)
    m.set_draft("tuned", 2)
    m.observe_step(verify(1, accepted=1), now=2.0)
    m.observe_step(verify(1, accepted=3), now=3.0)
    p = samples(m)
    assert value(p, "dflash_spec_decode_num_drafts_total", draft_version="1") == 1
    assert value(p, "dflash_spec_decode_num_accepted_tokens_total", draft_version="1") == 2
    assert value(p, "dflash_spec_decode_num_drafts_total", draft_version="2") == 2
    assert value(p, "dflash_spec_decode_num_accepted_tokens_total", draft_version="2") == 4
    assert value(p, "dflash_acceptance_length_count", draft_version="2") == 2
    per_pos = "dflash_spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(p, per_pos, position=str(k), draft_version="2") for k in range(B - 1)] == [2, 1, 1]
    infos = [dict(labels) for name, labels in p if name == "dflash_model_info"]
    assert infos == [{"target": "tiny-target", "draft": "tuned", "draft_version": "2", "block_size": str(B),
                      "device": "cpu", "backend": "hf"}]


def test_verify_width_buckets_reach_a_trees_widest_row() -> None:
    """Tree speculation verifies up to --tree-budget + 1 tokens a row: the histogram's buckets reach that far, so
    no tree lands in +Inf only (the demo pair with trees: block 16, budget 32, rows of up to 33)."""
    from dflash_core.config import EngineConfig
    from dflash_core.loading import load_models

    engine = load_models(EngineConfig(device="cpu", speculation="tree", kv_cache_memory="16MiB")).engine
    assert engine.max_verify_width == 33
    m = ServerMetrics(block_size=engine.block_size, target="t", draft="d", device="cpu", backend="native",
                      registry=CollectorRegistry(), max_verify_width=engine.max_verify_width)
    widths = sorted(float(dict(labels)["le"]) for name, labels in samples(m)
                    if name == "dflash_spec_decode_verify_width_bucket")
    assert widths == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 33.0, math.inf]
