#!/usr/bin/env python
"""The draft that learns, end to end on the demo pair (a benchmark command, not a test; ~10-15 min on 2 cores).

1. `dflash-serve --record-traffic DIR --adapt-draft ...` serves a traffic style the demo draft was never trained on
   (`dflash_core.demo.code_prefixes`: raw Python code to continue, on /v1/completions), greedy, from --clients
   concurrent clients, without a pause: before, during and after the adaptation cycle (fine-tune, gate, swap).
2. Once the cycle has swapped the new draft in and --after more requests were answered, the load stops. Every
   request must have succeeded.
3. A `--no-speculative` server answers every distinct prompt again: every text must equal what the adapting
   server answered, before and after the swap (zero changed tokens).
4. The cycle's gate (the held-out slice of the records, by request id, never trained on): the old and the new
   draft's mean acceptance length, measured by the engine.
5. `dflash-bench offline` on that held-out slice with the old draft and with the new one: plain decoding against
   DFlash, the speedup before and after.

  python scripts/adapt_proof.py --out /tmp/adapt_proof.json
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_core.bench.serving_paths import ServerProcess  # noqa: E402
from dflash_core.demo.code_prefixes import code_prefixes  # noqa: E402
from dflash_core.loading import DEMO_DRAFT  # noqa: E402


class Clients:
    """`n` threads sending completions of the prompts in turn (cycling) until stopped; every answer kept."""

    def __init__(self, url: str, prompts: list[str], n: int, max_tokens: int) -> None:
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.answers: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._next: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._count = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _take(self) -> int:
        with self._lock:
            i, self._count = self._count, self._count + 1
        return i

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                i = self._take()
                prompt = self.prompts[i % len(self.prompts)]
                body = {"model": "demo", "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0}
                t0 = time.monotonic()
                try:
                    r = client.post(f"{self.url}/v1/completions", json=body)
                    ok = r.status_code == 200
                    answer = {"prompt": prompt, "status": r.status_code, "t": t0,
                              "text": r.json()["choices"][0]["text"] if ok else r.text,
                              "al": r.json().get("dflash", {}).get("mean_acceptance_length") if ok else None}
                except httpx.HTTPError as exc:
                    answer = {"prompt": prompt, "status": None, "t": t0, "text": repr(exc), "al": None}
                with self._lock:
                    self.answers.append(answer)

    def count(self) -> int:
        with self._lock:
            return len(self.answers)


def draft_version(url: str) -> int:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["dflash"]["draft_version"]


def bench_offline(heldout: Path, draft: str, n: int, max_tokens: int, out: Path) -> dict[str, Any]:
    """`dflash-bench offline` on the held-out records with `draft`: its summary."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dflash_core.bench", "offline", "--dataset", str(heldout), "--draft", draft,
           "--num-prompts", str(n), "--max-tokens", str(max_tokens), "--no-plots", "--no-progress",
           "--output-dir", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads((out / "offline.json").read_text())["summary"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=400, help="distinct code prefixes in the traffic")
    p.add_argument("--clients", type=int, default=2, help="concurrent clients (the load during the swap)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per completion")
    p.add_argument("--min-records", type=int, default=300, help="--adapt-min-records: requests before the cycle")
    p.add_argument("--steps", type=int, default=300, help="--adapt-steps")
    p.add_argument("--after", type=int, default=40, help="requests answered after the swap before the load stops")
    p.add_argument("--eval-n", type=int, default=40, help="held-out requests the gate and the benchmark run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the swap")
    p.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    p.add_argument("--out", type=Path, default=None, help="write the report JSON here")
    args = p.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="dflash-adapt-proof-"))
    records = work / "records"
    prompts = code_prefixes(args.prompts, seed=0)
    train_args = f"--cache-hidden --eval-n {args.eval_n} --eval-max-new-tokens {args.max_tokens}"
    server = ServerProcess(["--device", "cpu", "--served-model-name", "demo", "--record-traffic", str(records),
                            "--adapt-draft", "--adapt-interval", "5", "--adapt-min-records", str(args.min_records),
                            "--adapt-steps", str(args.steps), "--adapt-train-args", train_args])
    clients = None
    try:
        server.wait_ready()
        clients = Clients(server.url, prompts, args.clients, args.max_tokens)
        t0 = time.monotonic()
        clients.start()
        deadline = t0 + args.timeout
        while draft_version(server.url) == 1:
            if time.monotonic() > deadline or server.proc.poll() is not None:
                raise SystemExit(f"no swap within {args.timeout:.0f} s: {server.tail(20)}")
            time.sleep(1)
        swapped = time.monotonic()
        at_swap = clients.count()
        print(f"swapped in after {swapped - t0:.0f} s and {at_swap} requests; serving {args.after} more",
              flush=True)
        while clients.count() < at_swap + args.after:
            time.sleep(0.2)
        clients.join()
    finally:
        if clients is not None:
            clients.stop.set()
        server.stop()
    answers = clients.answers
    failed = [a for a in answers if a["status"] != 200]

    plain = ServerProcess(["--device", "cpu", "--served-model-name", "demo", "--no-speculative"])
    try:
        plain.wait_ready()
        with httpx.Client(timeout=120) as c:
            replay = {q: c.post(f"{plain.url}/v1/completions", json={
                "model": "demo", "prompt": q, "max_tokens": args.max_tokens, "temperature": 0,
            }).json()["choices"][0]["text"] for q in sorted({a["prompt"] for a in answers})}
    finally:
        plain.stop()
    changed = [a for a in answers if a["status"] == 200 and a["text"] != replay[a["prompt"]]]

    cycle_dir = records / "adapted" / "cycle-0001"
    cycle = json.loads((cycle_dir / "cycle.json").read_text())
    heldout = cycle_dir / "heldout.jsonl"
    n = min(args.eval_n, sum(1 for line in heldout.read_text().splitlines() if line.strip()))
    before = bench_offline(heldout, str(DEMO_DRAFT), n, args.max_tokens, work / "bench-before")
    after = bench_offline(heldout, str(cycle_dir), n, args.max_tokens, work / "bench-after")

    def served_al(xs: list[dict[str, Any]]) -> float | None:
        vals = [a["al"] for a in xs if a["al"] is not None]
        return sum(vals) / len(vals) if vals else None

    report = {
        "requests": len(answers), "failed": len(failed), "changed_texts": len(changed),
        "swap_after_s": round(swapped - t0, 1), "requests_before_swap": at_swap,
        "cycle": cycle,
        "heldout_acceptance_rise": cycle["new_acceptance_length"] - cycle["old_acceptance_length"],
        "served_mean_acceptance": {
            "first_requests": served_al(sorted(answers, key=lambda a: a["t"])[: args.min_records]),
            "after_swap": served_al([a for a in answers if a["t"] > swapped]),
        },
        "bench_prompts": n,
        "bench_before": {k: before[k] for k in ("speedup", "mean_acceptance_length", "identical_outputs")},
        "bench_after": {k: after[k] for k in ("speedup", "mean_acceptance_length", "identical_outputs")},
        "work": str(work),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    ok = not failed and not changed and report["heldout_acceptance_rise"] >= 1.0
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
