"""A real Prometheus scrapes a real dflash server under load; PromQL agrees with what the API returned.

Acceptance test of the metrics issue: `python -m server` on the bundled demo pair (a trained draft, so the
acceptance counters are far from trivial) and `/usr/bin/prometheus`
(scrape interval 1 s), both on 127.0.0.1; a short mixed load (chat and completions, streaming and not, greedy
and sampled) through the real `openai` client; then, with the server idle again:
- PromQL ``1 + increase(accepted[w]) / increase(drafts[w])`` equals the mean acceptance length computed from
  the per-request ``dflash`` summaries the API returned (the window covers the server's whole life and the
  counters start at 0, so Prometheus' extrapolation scales both increases by the same factor);
- the token and spec-decode counters equal the usage / summary totals (instant queries, exact);
- histogram counts equal the number of requests (or verify steps, or tokens) served;
- running and waiting gauges are back to 0; the per-position counters equal what the acceptance-length histogram
  implies position by position (accepted at position k == drafts with acceptance length >= k + 2), which an
  off-by-one in either fails;
- `promtool check metrics` finds no problem in `/metrics` after the traffic.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server_fixtures import ServerProcess, free_port, log_tail, start_server, stop_process

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
N_REQUESTS = 8
DEMO_PROMPTS = [  # tasks the demo pair was trained on: its draft is accepted for many tokens per step
    "Divide 296 by 8.", "Convert 5 kilometers to meters.", "What is 48 + 27?",
    "Write a Python function that returns the maximum of a list.",
]
SERVER_START_TIMEOUT_S = 90.0

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus absent (Debian package `prometheus`; .ci/run installs it)"
)


Procs = list[tuple[subprocess.Popen[bytes], Path]]


def wait_until(what: str, check: Any, timeout_s: float, procs: Procs) -> None:
    """Poll ``check()`` every 0.2 s until it is truthy; fail after ``timeout_s`` or when a process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc, log in procs:
            if proc.poll() is not None:
                name = Path(str(proc.args[0])).name
                pytest.fail(f"{name} exited ({proc.returncode}) while waiting for {what}:\n{log_tail(log)}")
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.2)
    tails = "\n".join(f"--- {log.name}\n{log_tail(log)}" for _, log in procs)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")


@dataclass
class Stack:
    """The running server and Prometheus."""

    server: ServerProcess
    prom_url: str
    started_at: float  # time.time() before Prometheus started
    procs: Procs


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Start the dflash server on the demo pair and a Prometheus scraping it every second."""
    tmp = tmp_path_factory.mktemp("prom_e2e")
    prom_port = free_port()
    prom_log = tmp / "prometheus.log"
    config = tmp / "prometheus.yml"
    started_at = time.time()
    procs: Procs = []
    try:
        # fixed widths: the test asserts the draft's acceptance (the adaptive policy may stop drafting under load)
        server = start_server(["--device", "cpu", "--speculation", "fixed"], tmp / "server.log")
        procs.append((server.proc, server.log))
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: dflash\n    metrics_path: /metrics\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{server.port}']\n"
        )
        with prom_log.open("wb") as plog:
            procs.append((
                subprocess.Popen(
                    [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                     f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                    cwd=tmp, stdout=plog, stderr=subprocess.STDOUT,
                ),
                prom_log,
            ))
        yield Stack(server, f"http://127.0.0.1:{prom_port}", started_at, procs)
    finally:
        for proc, _ in reversed(procs):
            stop_process(proc, timeout_s=10)


def prom_query(stack: Stack, expr: str, at: float) -> list[dict[str, Any]]:
    """Instant PromQL query at time ``at``; the result vector."""
    r = httpx.get(f"{stack.prom_url}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"}, timeout=5)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def prom_value(stack: Stack, expr: str, at: float) -> float:
    """The single value of an instant query."""
    result = prom_query(stack, expr, at)
    assert len(result) == 1, (expr, result)
    return float(result[0]["value"][1])


@dataclass
class Served:
    """What the API returned for one request."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float


def summary_of(obj: Any) -> dict[str, Any]:
    """The ``dflash`` per-request summary of a response or final usage chunk."""
    extra = obj.model_extra or {}
    summary = extra.get("dflash")
    assert isinstance(summary, dict), f"no `dflash` summary on {obj!r}"
    return summary


def served_from(usage: Any, finish_reason: str | None, summary: dict[str, Any]) -> Served:
    """Collect the per-request numbers the API returned."""
    assert usage is not None and finish_reason is not None
    return Served(
        usage.prompt_tokens, usage.completion_tokens, finish_reason, int(summary["num_drafts"]),
        int(summary["num_draft_tokens"]), int(summary["num_accepted_tokens"]),
        float(summary["mean_acceptance_length"]),
    )


def one_request(client: openai.OpenAI, model: str, i: int) -> Served:
    """Request ``i`` of the load: chat or completion x streaming or not x greedy or sampled."""
    chat, stream, sampled = i % 2 == 0, (i // 2) % 2 == 1, (i // 4) % 2 == 1
    params: dict[str, Any] = {"model": model, "max_tokens": 24 + 8 * i}
    params["temperature"] = 0.8 if sampled else 0.0
    if sampled:
        params.update(top_p=0.95, seed=1000 + i)
    if stream:
        params.update(stream=True, stream_options={"include_usage": True})
    text = DEMO_PROMPTS[i % len(DEMO_PROMPTS)]
    if chat:
        resp: Any = client.chat.completions.create(messages=[{"role": "user", "content": text}], **params)
    else:  # the demo's chat format, written out by hand
        resp = client.completions.create(prompt=f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                                         **params)
    if not stream:
        return served_from(resp.usage, resp.choices[0].finish_reason, summary_of(resp))
    finish_reason, usage, summary = None, None, None
    for chunk in resp:
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
        if chunk.usage is not None:
            usage, summary = chunk.usage, summary_of(chunk)
    assert summary is not None, "stream ended without a usage chunk"
    return served_from(usage, finish_reason, summary)


def test_prometheus_scrapes_match_api(stack: Stack) -> None:
    """Mean acceptance length, token counters, histogram counts and gauges in Prometheus match the API."""
    stack.server.wait_ready(SERVER_START_TIMEOUT_S)
    wait_until("Prometheus ready", lambda: httpx.get(f"{stack.prom_url}/-/ready", timeout=2).is_success,
               20.0, stack.procs)
    # Load starts only after Prometheus holds a sample of the idle server: every counter's first sample is 0.
    wait_until(
        "a first scrape",
        lambda: prom_query(stack, 'up{job="dflash"} == 1 and on() dflash_spec_decode_num_drafts_total >= 0',
                           time.time()),
        20.0, stack.procs,
    )
    at0 = time.time()
    for name in ("dflash_spec_decode_num_drafts_total", "dflash_generation_tokens_total",
                 "dflash_prompt_tokens_total", "sum(dflash_requests_total)"):
        assert prom_value(stack, name, at0) == 0, f"{name} is not 0 before any traffic (warm-up counted?)"

    client = openai.OpenAI(base_url=f"{stack.server.url}/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(max_workers=4) as pool:
        served = list(pool.map(lambda i: one_request(client, model, i), range(N_REQUESTS)))

    # Idle again, and Prometheus has scraped it: every request counted, nothing running or waiting.
    snapshot: list[float] = []

    def settled() -> bool:
        at = time.time()
        done = prom_query(stack, f"sum(dflash_requests_total) == {N_REQUESTS}", at)
        idle = prom_query(stack, "dflash_num_requests_running + dflash_num_requests_waiting == 0", at)
        snapshot[:] = [at]
        return bool(done and idle)

    wait_until("Prometheus to see the finished load with the server idle", settled, 20.0, stack.procs)
    at = snapshot[0]

    def q(expr: str) -> float:
        return prom_value(stack, expr, at)

    drafts = sum(s.num_drafts for s in served)
    accepted = sum(s.num_accepted_tokens for s in served)
    generated = sum(s.completion_tokens for s in served)
    assert drafts > 0, "the load produced no draft blocks"
    assert 1 + accepted / drafts > 3.0, "the demo draft should be accepted for several tokens per step"
    for s in served:
        assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / max(s.num_drafts, 1),
                                                         abs=0.006)

    # Acceptance criterion 2: PromQL mean acceptance length == the API's, within rounding.
    window = f"{int(at - stack.started_at) + 10}s"  # covers the server's whole life, first samples are 0
    promql = q(f"1 + increase(dflash_spec_decode_num_accepted_tokens_total[{window}])"
               f" / increase(dflash_spec_decode_num_drafts_total[{window}])")
    expected = 1 + accepted / drafts
    assert promql == pytest.approx(expected, rel=1e-9)
    from_means = 1 + sum((s.mean_acceptance_length - 1) * s.num_drafts for s in served) / drafts
    assert promql == pytest.approx(from_means, abs=0.006)
    assert q("1 + dflash_spec_decode_num_accepted_tokens_total / dflash_spec_decode_num_drafts_total") == (
        pytest.approx(expected, rel=1e-12))

    # Token and spec-decode counters == usage / summary totals (exact).
    assert q("dflash_prompt_tokens_total") == sum(s.prompt_tokens for s in served)
    assert q("dflash_generation_tokens_total") == generated
    assert q("dflash_spec_decode_num_drafts_total") == drafts
    assert q("dflash_spec_decode_num_accepted_tokens_total") == accepted
    (info,) = prom_query(stack, "dflash_model_info == 1", at)
    block_size = int(info["metric"]["block_size"])
    assert block_size > 1
    draft_tokens = sum(s.num_draft_tokens for s in served)
    assert q("dflash_spec_decode_num_draft_tokens_total") == draft_tokens
    assert accepted <= draft_tokens <= drafts * (block_size - 1)  # blocks shrink near max_tokens
    for reason in ("stop", "length"):
        count = sum(s.finish_reason == reason for s in served)
        assert q(f'dflash_requests_total{{finished_reason="{reason}"}}') == count, reason

    # Acceptance criterion 3: histogram counts == requests / verify steps / tokens served.
    for name in ("dflash_e2e_request_latency_seconds", "dflash_request_queue_time_seconds",
                 "dflash_time_to_first_token_seconds", "dflash_request_generation_tokens"):
        assert q(f"{name}_count") == N_REQUESTS, name
    assert q("dflash_request_generation_tokens_sum") == generated
    assert q("dflash_inter_token_latency_seconds_count") == generated - N_REQUESTS
    assert q("dflash_acceptance_length_count") == drafts
    assert q("dflash_acceptance_length_sum") == drafts + accepted
    assert q('dflash_acceptance_length_bucket{le="+Inf"}') == drafts
    assert q("dflash_num_requests_running") == 0
    assert q("dflash_num_requests_waiting") == 0
    per_pos = prom_query(stack, "dflash_spec_decode_num_accepted_tokens_per_pos_total", at)
    by_pos = {int(r["metric"]["position"]): float(r["value"][1]) for r in per_pos}
    assert sorted(by_pos) == list(range(block_size - 1))
    assert sum(by_pos.values()) == accepted
    assert all(v <= drafts for v in by_pos.values())
    assert all(by_pos[k + 1] <= by_pos[k] for k in range(block_size - 2))  # accepted prefixes
    assert by_pos[0] > by_pos[block_size - 2] and by_pos[3] > 0  # non-trivial: deep positions are reached
    for k in range(block_size - 1):  # accepted at position k <=> acceptance length >= k + 2
        at_most = q(f'dflash_acceptance_length_bucket{{le="{float(k + 1)}"}}')
        assert by_pos[k] == drafts - at_most, (k, by_pos[k], drafts, at_most)
    over = ("dflash_spec_decode_num_accepted_tokens_per_pos_total"
            " > on() group_left dflash_spec_decode_num_drafts_total")
    assert not prom_query(stack, over, at)

    # Acceptance criterion 1: promtool finds no problem in /metrics after real traffic.
    body = httpx.get(f"{stack.server.url}/metrics", timeout=5).content
    assert b"dflash_spec_decode_num_drafts_total" in body
    if PROMTOOL is not None:
        proc = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=30,
                              check=False)
        assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), (proc.stdout + proc.stderr)
