"""`--adapt-draft` on a real server: the recorded traffic fine-tunes the draft in a child process, the gate
promotes it, and it is swapped in while requests keep coming, none failing and none changing a token."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from dflash_core import LLM, SamplingParams
from dflash_core.demo.code_prefixes import code_prefixes
from server.adapt import count_records
from tests.helpers import noisy_demo_draft
from tests.server_fixtures import start_server

BOUND_S = 240.0  # an upper bound of the cycle (training, then both drafts measured), never a pass condition
MAX_TOKENS = 40


class Load(threading.Thread):
    """Completions of code prefixes, one after another, until stopped: every answer's status and text."""

    def __init__(self, url: str, prompts: list[str]) -> None:
        super().__init__(daemon=True)
        self.url, self.prompts = url, prompts
        self.answers: list[tuple[str, int, str]] = []
        self.done = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.done.is_set():
            prompt = self.prompts[i % len(self.prompts)]
            body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
            self.answers.append((prompt, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200
                                 else r.text))
            i += 1


def draft_version(url: str) -> int:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["dflash"]["draft_version"]


def test_a_cycle_fine_tunes_gates_and_swaps_the_draft_while_serving(tmp_path: Path) -> None:
    start = noisy_demo_draft(tmp_path / "start-draft", scale=4.0)  # a draft that agrees with the target ~never
    records = tmp_path / "records"
    train_args = "--batch-size 4 --eval-n 6 --eval-max-new-tokens 32 --heldout-fraction 0.25 --cache-hidden"
    server = start_server(["--device", "cpu", "--draft", str(start), "--speculation", "fixed",
                           "--served-model-name", "demo", "--record-traffic", str(records), "--adapt-draft",
                           "--adapt-interval", "0.5", "--adapt-min-records", "24", "--adapt-steps", "40",
                           "--adapt-gate-margin", "0", "--adapt-train-args", train_args], tmp_path / "server.log")
    prompts = code_prefixes(40, seed=1)
    load = Load(server.url, prompts)
    try:
        server.wait_ready()
        load.start()
        deadline = time.monotonic() + BOUND_S
        while draft_version(server.url) == 1 and time.monotonic() < deadline and server.proc.poll() is None:
            time.sleep(0.2)
        swapped_at = len(load.answers)
        while len(load.answers) < swapped_at + 4:  # requests served by the new draft, after the swap
            time.sleep(0.05)
        load.done.set()
        load.join(60)
        assert draft_version(server.url) == 2, server.log_tail()
    finally:
        load.done.set()
        server.terminate()
    cycle = json.loads((records / "adapted" / "cycle-0001" / "cycle.json").read_text())
    assert cycle["promoted"] and cycle["draft_version"] == 2 and cycle["returncode"] == 0
    assert cycle["new_acceptance_length"] >= cycle["old_acceptance_length"]
    assert cycle["records"] >= 24 and count_records(records) >= cycle["records"]
    assert "draft adaptation cycle 1:" in server.log_tail(20000)
    # under load, before, during and after the swap: no failure, and every text is plain decoding's
    assert {status for _, status, _ in load.answers} == {200}
    plain = LLM(speculative=False, device="cpu")
    texts = {p: g.text for p, g in zip(prompts, plain.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS)))}
    assert [text for _, _, text in load.answers] == [texts[p] for p, _, _ in load.answers]
