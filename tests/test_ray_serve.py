"""``dflash-serve-ray``: two replicas of the demo pair behind Ray Serve's HTTP proxy on 127.0.0.1.

One Ray cluster serves the whole module (starting one costs ~20 s on 2 cores). Requests go through the real proxy
with the openai client and httpx; each replica's own metrics endpoint (``--replica-metrics-port`` + its rank)
shows which replica did the work, and ``dflash_replica_info`` gives its pid, which the kill test SIGKILLs.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_core import LLM, SamplingParams
from server.ray_serve import REPLICA_HEADER, ScaleOut, deployment_options, parse_args
from tests.server_fixtures import REPO, free_port, log_tail

START_TIMEOUT_S = 150.0
RESTART_TIMEOUT_S = 90.0
MODEL = "dflash-demo"
QUESTIONS = [
    "Convert 5 kilometers to meters.",
    "What is 48 plus 27?",
    "Write a Python function that reverses a string.",
    "What is 12 times 7?",
    "Convert 3 hours to minutes.",
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "What is 100 minus 37?",
]
MAX_TOKENS = 32
HEALTHY_2 = "deployment DFlashReplica: HEALTHY, replicas RUNNING=2"


def _free_port_pair() -> int:
    """A port p such that p and p + 1 are free on 127.0.0.1 (the two replicas' metrics ports)."""
    for _ in range(50):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


@dataclass
class Replica:
    """What one replica's own metrics endpoint says."""

    replica_id: str
    pid: int
    finished: float  # dflash_requests_total over every finish reason


@dataclass
class RayServer:
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log: Path
    replicas: int = 2
    reference: dict[str, str] = field(default_factory=dict)  # question -> the in-process engine's greedy answer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def replica(self, rank: int) -> Replica | None:
        """The replica of local rank ``rank``, from its own /metrics (None while it is not up)."""
        try:
            body = httpx.get(f"http://127.0.0.1:{self.metrics_port + rank}/metrics", timeout=2).text
        except httpx.HTTPError:
            return None
        info, finished = None, 0.0
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                if s.name == "dflash_replica_info":
                    info = (s.labels["replica"], int(s.labels["pid"]))
                elif s.name == "dflash_requests_total":
                    finished += s.value
        return None if info is None else Replica(info[0], info[1], finished)

    def all_replicas(self) -> list[Replica]:
        found = [self.replica(rank) for rank in range(self.replicas)]
        assert all(r is not None for r in found), "a replica's metrics endpoint does not answer"
        return found  # type: ignore[return-value]

    def statuses(self) -> list[str]:
        """The deployment status lines the CLI logged (one per change), oldest first."""
        return [line.strip() for line in re.findall(r"dflash\.ray: (deployment DFlashReplica: .*)",
                                                    log_tail(self.log, 10**7))]

    def last_status(self) -> str:
        return (self.statuses() or [""])[-1]

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dflash-serve-ray exited with {self.proc.returncode}:\n{log_tail(self.log)}")
            try:
                up = httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                up = False
            if up and all(self.replica(r) is not None for r in range(self.replicas)):
                return
            time.sleep(0.25)
        raise RuntimeError(f"dflash-serve-ray not ready after {timeout_s:.0f} s:\n{log_tail(self.log)}")


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _start(tmp: Path) -> RayServer:
    port, metrics_port = free_port(), _free_port_pair()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0",
               # Serve runs actors only: idle task workers started ahead would just compete for the 2 cores
               RAY_prestart_worker_first_driver="0", RAY_enable_worker_prestart="0",
               RAY_DEDUP_LOGS="0")  # every replica's lines in the log, not "[repeated 2x across cluster]"
    log = tmp / "ray-serve.log"
    args = [
        "--replicas", "2", "--ray-num-cpus", "2", "--replica-cpus", "1", "--replica-metrics-port", str(metrics_port),
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
        "--max-running-requests", "8", "--shutdown-timeout", "5",
    ]
    with log.open("wb") as out:
        # its own session: a signal meant for pytest does not reach Ray's processes, and the cleanup below can
        # end the whole group it started
        proc = subprocess.Popen([sys.executable, "-m", "server.ray_serve", *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return RayServer(proc, port, metrics_port, log)


def _reference() -> dict[str, str]:
    """Greedy answers of the same engine in-process (``dflash_core.LLM``), the single-server reference."""
    llm = LLM(device="cpu", dtype="float32", max_running_requests=8)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.generate(chats, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return {q: o.text for q, o in zip(QUESTIONS, outs)}


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    server = _start(tmp_path_factory.mktemp("ray"))
    try:
        server.reference = _reference()  # while Ray starts
        server.wait_ready()
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait(timeout=10)


def _ask(client: openai.OpenAI, question: str, stream: bool) -> tuple[str, str]:
    """(answer, replica id) of one greedy chat completion."""
    messages = [{"role": "user", "content": question}]
    if stream:
        with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        ) as response:
            replica = response.headers[REPLICA_HEADER]
            text = "".join(c.choices[0].delta.content or "" for c in response.parse() if c.choices)
        return text, replica
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    return raw.parse().choices[0].message.content or "", raw.headers[REPLICA_HEADER]


def test_cli_parses_scale_flags_and_refuses_bad_ones() -> None:
    settings, scale = parse_args(["--replicas", "3", "--max-replicas", "6", "--max-running-requests", "4"])
    assert scale == ScaleOut(replicas=3, max_replicas=6) and scale.autoscaling and settings.max_running_requests == 4
    # dflash-serve's flags pass through whole: --target is not taken for a prefix of --target-ongoing-requests
    settings, scale = parse_args(["--target", "/models/t", "--replicas", "2"])
    assert settings.target == "/models/t" and scale.target_ongoing_requests is None
    bad_lines = (["--replicas", "0"], ["--replicas", "x"], ["--min-replicas", "2"],
                 ["--replicas", "5", "--max-replicas", "2"],
                 ["--record-traffic", "/tmp/records", "--adapt-draft"])  # each replica would train on its own
    for bad in bad_lines:
        with pytest.raises(ValueError):
            parse_args(bad)
    res = subprocess.run([sys.executable, "-m", "server.ray_serve", "--replicas", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.strip() == "dflash-serve-ray: error: --replicas must be >= 1"


def test_deployment_options_tie_ray_to_the_engine_queue() -> None:
    """Ray's limits follow the engine's: a replica takes its running + waiting requests, the proxy queues up to
    max_waiting_requests more, then 429; autoscaling aims at max_running_requests ongoing per replica. Ray's own
    config models accept every key."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig

    settings, scale = parse_args(["--replicas", "2", "--max-replicas", "4", "--max-running-requests", "6",
                                  "--max-waiting-requests", "10", "--device", "cpu"])
    options = deployment_options(settings, scale)
    auto = AutoscalingConfig(**options["autoscaling_config"])
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas) == (1, 2, 4)
    assert auto.target_ongoing_requests == 6 and "num_replicas" not in options
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}

    class Probe:
        pass

    deployment = serve.deployment(**options)(Probe)
    assert deployment.max_ongoing_requests == 16 and deployment.max_queued_requests == 10
    fixed = deployment_options(*parse_args(["--replicas", "3", "--device", "cuda", "--replica-cpus", "4"]))
    assert fixed["num_replicas"] == 3 and fixed["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 1.0}
    assert "autoscaling_config" not in fixed


def test_each_replica_warms_up_on_the_thread_that_serves(ray_server: RayServer) -> None:
    """A replica is up only once its worker thread has run `Engine.warm_up` (recorded CUDA graphs are per thread:
    a warm-up on the loading thread would leave the serving thread to record them again mid-traffic)."""
    deadline = time.monotonic() + 30  # Ray forwards the replicas' log lines to the driver's output a little later
    while True:
        text = ray_server.log.read_text(errors="replace")
        if len(re.findall(r"warmed up on the worker thread in [0-9.]+ s", text)) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(re.findall(r"warmed up on the worker thread in [0-9.]+ s", text)) >= 2, log_tail(ray_server.log)


def test_two_replicas_share_16_concurrent_requests_with_single_server_outputs(ray_server: RayServer) -> None:
    before = {r.replica_id: r.finished for r in ray_server.all_replicas()}
    client = openai.OpenAI(base_url=f"{ray_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    jobs = [(q, stream) for q in QUESTIONS for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _ask(client, *job), jobs))
    for (question, stream), (text, _) in zip(jobs, results):
        assert text == ray_server.reference[question], (question, stream)
    # a replica counts a request once its worker has seen it finish, which may come just after the last byte
    deadline = time.monotonic() + 10
    while True:
        after = {r.replica_id: r.finished for r in ray_server.all_replicas()}
        if sum(after.values()) - sum(before.values()) >= len(jobs) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after.keys() == before.keys()
    served = {rid: after[rid] - before[rid] for rid in after}
    assert sum(served.values()) == len(jobs) and all(n >= 1 for n in served.values()), served
    # every response named the replica that answered it, and the counts agree with that replica's counters
    by_header = {rid: sum(1 for _, r in results if r == rid) for rid in after}
    assert by_header == served


def _long_stream(url: str, outcome: dict[int, tuple[str, str, float]], i: int, started: threading.Event) -> None:
    """A streamed completion of 1,900 tokens, near the demo target's 2,048 positions (long enough to be running when
    a replica is killed right after every stream's first bytes: with the fused CPU step and three streams a replica,
    1,000 tokens have finished in 2.5 s); outcome[i] = (replica, "done" | "cut" | error name, seconds taken)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    replica, t0 = "", time.monotonic()
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60.0)) as r:
            replica = r.headers[REPLICA_HEADER]
            outcome[i] = (replica, "open", 0.0)
            started.set()
            lines = [line for line in r.iter_lines() if line]
        done = lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
        outcome[i] = (replica, "done" if done else "cut", time.monotonic() - t0)
    except httpx.HTTPError as e:
        outcome[i] = (replica, type(e).__name__, time.monotonic() - t0)


def test_killing_a_replica_mid_load_fails_only_its_requests_and_ray_restarts_it(ray_server: RayServer) -> None:
    outcome: dict[int, tuple[str, str, float]] = {}
    events = [threading.Event() for _ in range(6)]
    threads = [threading.Thread(target=_long_stream, args=(ray_server.url, outcome, i, events[i]), daemon=True)
               for i in range(6)]
    replicas = ray_server.all_replicas()  # before the streams: the kill follows their first bytes at once
    victim, survivor = replicas  # ranks 0 and 1
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in events), outcome
    on = {r.replica_id: [i for i, o in outcome.items() if o[0] == r.replica_id] for r in replicas}
    assert on[victim.replica_id] and on[survivor.replica_id], f"the 6 streams were not spread: {outcome}"
    seen_before = len(ray_server.statuses())
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()

    # while the victim is gone, new requests go to the survivor and succeed
    client = openai.OpenAI(base_url=f"{ray_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    for question in QUESTIONS[:3]:
        assert _ask(client, question, stream=False)[1] == survivor.replica_id

    for t in threads:
        t.join(timeout=150)
    assert not any(t.is_alive() for t in threads), f"a stream hangs: {outcome}"
    for i in on[survivor.replica_id]:
        assert outcome[i][1] == "done", outcome[i]
    for i in on[victim.replica_id]:  # an error, not a hang: well before the 60 s read timeout
        assert outcome[i][1] != "done" and outcome[i][2] < time.monotonic() - killed_at + 30, outcome[i]

    # Ray starts a replacement on the freed rank, and Serve reports two running replicas again
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    replacement = None
    while time.monotonic() < deadline:
        replacement = ray_server.replica(0)  # the victim's rank
        if replacement is not None and replacement.pid != victim.pid:
            break
        time.sleep(0.5)
    assert replacement is not None and replacement.replica_id != victim.replica_id, log_tail(ray_server.log)
    # the CLI logs the deployment's status changes (serve.status()): unhealthy after the kill, then two running
    while time.monotonic() < deadline and ray_server.last_status() != HEALTHY_2:
        time.sleep(0.5)
    assert ray_server.last_status() == HEALTHY_2, log_tail(ray_server.log)
    assert any("RUNNING=1" in line for line in ray_server.statuses()[seen_before:]), ray_server.statuses()
    assert _ask(client, QUESTIONS[0], stream=True)[0]


def test_sigterm_stops_the_cluster(ray_server: RayServer) -> None:
    pids = [r.pid for r in ray_server.all_replicas()]
    t0 = time.monotonic()
    ray_server.proc.send_signal(signal.SIGTERM)
    assert ray_server.proc.wait(timeout=90) == 0, log_tail(ray_server.log)
    elapsed = time.monotonic() - t0
    assert not [pid for pid in pids if _alive(pid)]
    assert elapsed < 60, elapsed
