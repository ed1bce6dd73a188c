"""Hot swap of the draft on a real server (``POST /v1/admin/draft``, SIGHUP): streams in flight finish without an
error or a changed token, the metrics carry the new ``draft_version``, and every way a swap can fail leaves the old
draft serving with a clear answer."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_core import LLM, SamplingParams
from dflash_core.draft import DFlashDraft
from dflash_core.loading import DEMO_DRAFT
from tests.engine_gate import BOUND_S, engine_requests, open_gate, set_gate, start_gated_server
from tests.helpers import noisy_demo_draft
from tests.server_fixtures import ServerProcess

KEY = "admin-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [[1, 40, 200, 7], list(range(30, 90)), [5, 5, 5], list(range(100, 300, 3))]
MAX_TOKENS = 48


@dataclass
class Served:
    server: ServerProcess
    gate: Path
    new_draft: Path
    folder: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("draft_swap")
    new_draft = noisy_demo_draft(tmp / "draft-v2", scale=0.3)
    gate = tmp / "gate"
    # fixed widths: the test counts drafts per draft version; the adaptive policy may stop drafting under load
    server = start_gated_server(["--device", "cpu", "--speculation", "fixed", "--api-key", KEY,
                                 "--served-model-name", "demo"], tmp / "server.log", gate)
    try:
        server.wait_ready()
        yield Served(server, gate, new_draft, tmp)
    finally:
        server.terminate()


def completion(url: str, prompt: list[int], out: dict[int, Any], i: int) -> None:
    """A streamed completion of `prompt` (greedy, EOS ignored): its text and finish reason, or the failure."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish, errors = "", None, []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=BOUND_S) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"])
                    continue
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
            out[i] = (r.status_code, text, finish, errors)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        out[i] = (None, text, finish, [repr(exc)])


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def admin(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/admin/draft", timeout=BOUND_S, **kwargs)


def test_a_swap_under_load_changes_no_token_and_moves_the_draft_version(served: Served) -> None:
    url = served.server.url
    plain = LLM(speculative=False, device="cpu")
    expected = [g.text for g in plain.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    set_gate(served.gate, 0)  # held until all four are in the engine (the HTTP requests arrive one by one)
    results: dict[int, Any] = {}
    threads = [threading.Thread(target=completion, args=(url, p, results, i)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + BOUND_S
        while engine_requests(served.gate) < len(PROMPTS) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine_requests(served.gate) == len(PROMPTS)
        active = served.gate.with_suffix(".active")
        paused = active.stat().st_mtime_ns
        set_gate(served.gate, 3)  # a prefill of all four and two verify steps, then every stream held mid-way
        while active.stat().st_mtime_ns == paused and time.monotonic() < deadline:  # rewritten when paused again
            time.sleep(0.02)
        r = admin(url, json={"path": str(served.new_draft)}, headers=AUTH)
        assert r.status_code == 200, r.text
        swapped = r.json()
        assert swapped["draft_version"] == 2 and swapped["path"] == str(served.new_draft)
        assert swapped["restarted_requests"] == len(PROMPTS)  # all four held memory mid-stream
    finally:
        open_gate(served.gate)  # the server's later tests need it running
    for t in threads:
        t.join(BOUND_S)
    assert [results[i][0] for i in range(len(PROMPTS))] == [200] * len(PROMPTS)
    assert [results[i][3] for i in range(len(PROMPTS))] == [[]] * len(PROMPTS)  # no error event in any stream
    assert [results[i][1] for i in range(len(PROMPTS))] == expected  # token for token, plain decoding's text
    m = metric_samples(url)
    assert m[("dflash_spec_decode_num_drafts_total", (("draft_version", "2"),))] > 0  # the new draft drafted
    assert ("dflash_spec_decode_num_drafts_total", (("draft_version", "1"),)) in m  # the old series stays
    (info,) = [dict(labels) for name, labels in m if name == "dflash_model_info"]
    assert info["draft_version"] == "2" and info["draft"] == "draft-v2"
    card = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]
    assert card["dflash"]["draft_version"] == 2 and card["dflash"]["draft"] == "draft-v2"


def test_a_failed_swap_answers_why_and_the_old_draft_serves_on(served: Served) -> None:
    url = served.server.url
    before = httpx.get(f"{url}/v1/admin/draft", headers=AUTH, timeout=10).json()
    other = DFlashDraft.from_folder(DEMO_DRAFT)
    other.cfg.num_hidden_layers = 1
    DFlashDraft(other.cfg).save(served.folder / "one-layer")
    cases = [
        ({"json": {"path": str(served.new_draft)}}, 401, "API key"),  # no key
        ({"json": {"path": str(served.folder / "missing")}, "headers": AUTH}, 400, "no draft folder"),
        ({"json": {"path": str(served.folder / "one-layer")}, "headers": AUTH}, 400, "num_hidden_layers (2 -> 1)"),
        ({"json": {"path": 3}, "headers": AUTH}, 400, "path"),
        ({"json": {"path": str(served.new_draft), "force": True}, "headers": AUTH}, 400, "force"),
        ({"content": b"{", "headers": {**AUTH, "Content-Type": "application/json"}}, 400, ""),
    ]
    for kwargs, status, words in cases:
        r = admin(url, **kwargs)
        assert r.status_code == status, (kwargs, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and words in err["message"], err
    assert httpx.get(f"{url}/v1/admin/draft", headers=AUTH, timeout=10).json() == before
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=BOUND_S).status_code == 200


def test_sighup_reads_the_draft_folder_again(served: Served) -> None:
    url = served.server.url
    before = httpx.get(f"{url}/v1/admin/draft", headers=AUTH, timeout=10).json()
    served.server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + BOUND_S
    now = before
    while now["draft_version"] == before["draft_version"] and time.monotonic() < deadline:
        time.sleep(0.05)
        now = httpx.get(f"{url}/v1/admin/draft", headers=AUTH, timeout=10).json()
    assert now == {**before, "draft_version": before["draft_version"] + 1}
    assert served.server.proc.poll() is None  # SIGHUP does not end the server


def test_without_an_api_key_the_admin_api_is_off(tmp_path: Path) -> None:
    from dflash_core.config import EngineConfig
    from dflash_core.loading import load_models
    from server.app import create_app
    from server.settings import Settings
    from tests.server_fixtures import InProcessServer

    models = load_models(EngineConfig(device="cpu", max_running_requests=2))
    server = InProcessServer(create_app(Settings(device="cpu"), models=models)).start()
    try:
        for r in (admin(server.url, json={"path": str(DEMO_DRAFT)}),
                  httpx.get(f"{server.url}/v1/admin/draft", timeout=10)):
            assert r.status_code == 403
            assert r.json()["error"]["code"] == "admin_api_disabled" and "--api-key" in r.json()["error"]["message"]
    finally:
        server.stop()
