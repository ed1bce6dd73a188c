#!/usr/bin/env python
"""dflash-serve against llama.cpp's DFlash (llama-server --spec-type draft-dflash) on the same CPU.

A benchmark command, not a test. Four servers, started one after another on free 127.0.0.1 ports:

  ours-dflash    dflash-serve --device cpu --threads N
  ours-plain     dflash-serve --device cpu --threads N --no-speculative
  llama-dflash   llama-server -m TARGET -md DRAFT --spec-type draft-dflash --spec-draft-n-max 15 -t N
  llama-plain    llama-server -m TARGET -t N

Each gets the same prompts (dflash-bench's default set: the shipped chat/math/code conversations,
interleaved, the first --num-prompts) through /v1/chat/completions, greedy, one request at a time, after one
untimed warm-up request. tok/s = total completion tokens / total wall time of the timed requests. --rounds
rounds, each running every configuration at every thread count (the order reversed on odd rounds);
reported: the median over rounds. Outputs are checked: every prompt's text must be the same in all
configurations, rounds and thread counts; the first mismatch is printed.

llama.cpp and the GGUF files come from scripts/llamacpp_build.sh (its llamacpp.env is read by default).

  python scripts/llamacpp_compare.py --rounds 2 --threads 1,2 --out /tmp/llamacpp_compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

CONFIGS = ("ours-dflash", "ours-plain", "llama-dflash", "llama-plain")
DEFAULT_ENV = Path.home() / ".cache" / "dflash-llamacpp" / "llamacpp.env"


def read_env(path: Path) -> dict[str, str]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if "=" in line:
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def dflash_serve_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "dflash-serve"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("dflash-serve")
    if not found:
        sys.exit("dflash-serve not found: activate the project's venv")
    return [found]


def server_cmd(config: str, threads: int, port: int, args: argparse.Namespace) -> list[str]:
    if config.startswith("ours"):
        cmd = dflash_serve_cmd() + ["--device", "cpu", "--threads", str(threads), "--host", "127.0.0.1",
                                    "--port", str(port), "--log-level", "warning"]
        if config == "ours-plain":
            cmd.append("--no-speculative")
        return cmd
    cmd = [args.llama_server, "-m", args.target_gguf, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-c", "2048", "-np", "1", "--jinja", "-fa", "on",
           "--no-webui"]
    if config == "llama-dflash":
        cmd += ["-md", args.draft_gguf, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(args.draft_n_max),
                "-td", str(threads), "-tbd", str(threads)]
    return cmd


class Server:
    def __init__(self, cmd: list[str], port: int, log_path: Path, env: dict[str, str]):
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {' '.join(self.cmd)}\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready in {timeout:.0f}s: {' '.join(self.cmd)}\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the process we started (its own session)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def chat(base: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "top_p": 1.0, "stream": False}
    t0 = time.perf_counter()
    try:
        resp = http_json(base + "/v1/chat/completions", body)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{base}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
    dt = time.perf_counter() - t0
    choice = resp["choices"][0]
    out = {"text": choice["message"].get("content") or "", "finish_reason": choice.get("finish_reason"),
           "completion_tokens": int(resp["usage"]["completion_tokens"]),
           "prompt_tokens": int(resp["usage"].get("prompt_tokens", 0)), "seconds": dt}
    timings = resp.get("timings") or {}  # llama-server: draft_n / draft_n_accepted when speculating
    if "draft_n" in timings:
        out["draft_n"], out["draft_n_accepted"] = timings["draft_n"], timings.get("draft_n_accepted")
    return out


def run_config(config: str, threads: int, prompts: list, args: argparse.Namespace, log_dir: Path,
               tag: str) -> dict:
    port = free_port()
    env = dict(os.environ)
    server = Server(server_cmd(config, threads, port, args), port, log_dir / f"{tag}-{config}-t{threads}.log", env)
    try:
        t_start = time.perf_counter()
        server.wait_ready(args.ready_timeout)
        ready_s = time.perf_counter() - t_start
        model = http_json(server.base + "/v1/models")["data"][0]["id"]
        chat(server.base, model, prompts[0].messages, 16)  # warm-up, untimed
        reqs = [chat(server.base, model, p.messages, args.max_tokens) for p in prompts]
    except Exception:
        print(f"--- {config} t{threads} log tail ---\n{server.tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()
    tokens = sum(r["completion_tokens"] for r in reqs)
    seconds = sum(r["seconds"] for r in reqs)
    res = {"config": config, "threads": threads, "ready_s": round(ready_s, 2), "completion_tokens": tokens,
           "seconds": seconds, "tok_s": tokens / seconds, "requests": reqs}
    drafted = sum(r.get("draft_n", 0) for r in reqs)
    if drafted:
        res["llama_draft_n"] = drafted
        res["llama_draft_accepted"] = sum(r.get("draft_n_accepted") or 0 for r in reqs)
    return res


def first_diff(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def compare(runs: list[dict], a_cfg: str, b_cfg: str) -> dict:
    """Every prompt's text in every run of a_cfg against the first run of b_cfg (itself too when equal)."""
    ref = next(r for r in runs if r["config"] == b_cfg)
    for run in runs:
        if run["config"] != a_cfg:
            continue
        for i, (x, y) in enumerate(zip(run["requests"], ref["requests"])):
            if x["text"] != y["text"]:
                k = first_diff(x["text"], y["text"])
                return {"identical": False, "prompt": i,
                        "a": f"{a_cfg} t{run['threads']} round {run['round']}",
                        "b": f"{b_cfg} t{ref['threads']} round {ref['round']}",
                        "at_char": k, "a_text": x["text"], "b_text": y["text"],
                        "a_tokens": x["completion_tokens"], "b_tokens": y["completion_tokens"]}
    return {"identical": True}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-env", type=Path, default=DEFAULT_ENV,
                    help=f"llamacpp.env written by scripts/llamacpp_build.sh (default: {DEFAULT_ENV})")
    ap.add_argument("--llama-server", help="llama-server binary (default: LLAMA_SERVER of --llama-env)")
    ap.add_argument("--target-gguf", help="target GGUF (default: TARGET_GGUF of --llama-env)")
    ap.add_argument("--draft-gguf", help="DFlash draft GGUF (default: DRAFT_GGUF of --llama-env)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default: 1,2)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--dataset", default="all", help="as dflash-bench --dataset (default: all, its default)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-n-max", type=int, default=15,
                    help="llama-server --spec-draft-n-max: 15 drafted tokens + 1 = the draft's block of 16")
    ap.add_argument("--ready-timeout", type=float, default=180.0)
    ap.add_argument("--log-dir", type=Path, help="server logs (default: a temporary directory)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()

    from dflash_core.bench.prompts import load_prompts

    env = read_env(args.llama_env)
    args.llama_server = args.llama_server or env.get("LLAMA_SERVER")
    args.target_gguf = args.target_gguf or env.get("TARGET_GGUF")
    args.draft_gguf = args.draft_gguf or env.get("DRAFT_GGUF")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        sys.exit(f"unknown configs {bad}: choose from {CONFIGS}")
    if any(c.startswith("llama") for c in configs):
        for name in ("llama_server", "target_gguf", "draft_gguf"):
            if not getattr(args, name) or not Path(getattr(args, name)).exists():
                sys.exit(f"--{name.replace('_', '-')} missing ({getattr(args, name)}): run scripts/llamacpp_build.sh")
    threads = [int(t) for t in args.threads.split(",")]
    prompts = load_prompts(args.dataset, args.num_prompts)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="llamacpp_compare_"))
    log_dir.mkdir(parents=True, exist_ok=True)

    runs = []
    for rnd in range(args.rounds):
        order = [(t, c) for t in threads for c in configs]
        if rnd % 2:
            order.reverse()
        for t, c in order:
            res = run_config(c, t, prompts, args, log_dir, f"r{rnd}")
            res["round"] = rnd
            runs.append(res)
            print(f"round {rnd} {c:13s} t{t}: {res['completion_tokens']:5d} tokens in {res['seconds']:7.2f} s = "
                  f"{res['tok_s']:7.1f} tok/s (ready {res['ready_s']:.1f} s)", flush=True)

    # outputs
    checks = {}
    present = set(configs)
    pairs = [("ours-dflash", "ours-plain"), ("llama-dflash", "llama-plain"), ("ours-plain", "llama-plain"),
             ("ours-dflash", "llama-dflash")]
    for a, b in pairs:
        if a in present and b in present:
            checks[f"{a} == {b}"] = compare(runs, a, b)
    for c in configs:  # each configuration against itself: rounds and thread counts
        checks[f"{c} stable"] = compare(runs, c, c)

    # table
    summary = []
    for t in threads:
        plain_rate = {}
        for c in configs:
            rates = [r["tok_s"] for r in runs if r["config"] == c and r["threads"] == t]
            med = statistics.median(rates)
            if c.endswith("plain"):
                plain_rate[c.split("-")[0]] = med
            summary.append({"config": c, "threads": t, "tok_s_rounds": rates, "tok_s_median": med})
        for s in summary:
            if s["threads"] == t:
                base = plain_rate.get(s["config"].split("-")[0])
                s["vs_own_plain"] = s["tok_s_median"] / base if base else None
    for s in summary:
        rr = [r for r in runs if r["config"] == s["config"] and r["threads"] == s["threads"]]
        s["completion_tokens"] = rr[0]["completion_tokens"]
        if "llama_draft_n" in rr[0]:
            s["llama_acceptance"] = rr[0]["llama_draft_accepted"] / rr[0]["llama_draft_n"]

    print()
    print("| configuration | threads | tok/s per round | median tok/s | vs same engine plain | tokens |")
    print("|---|---:|---|---:|---:|---:|")
    for s in summary:
        vs = f"{s['vs_own_plain']:.2f}x" if s.get("vs_own_plain") else "-"
        rounds = ", ".join(f"{x:.1f}" for x in s["tok_s_rounds"])
        print(f"| {s['config']} | {s['threads']} | {rounds} | {s['tok_s_median']:.1f} | {vs} | "
              f"{s['completion_tokens']} |")
    print()
    for name, chk in checks.items():
        if chk["identical"]:
            print(f"outputs {name}: identical")
        else:
            print(f"outputs {name}: DIFFER, first at prompt {chk['prompt']} char {chk['at_char']} "
                  f"({chk['a']} vs {chk['b']}; {chk['a_tokens']} vs {chk['b_tokens']} tokens)")
            print(f"  {chk['a']}: {chk['a_text']!r}")
            print(f"  {chk['b']}: {chk['b_text']!r}")

    if args.out:
        result = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform()},
            "llamacpp_version": env.get("LLAMACPP_VERSION"),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "commands": {c: server_cmd(c, threads[0], 0, args) for c in configs},
            "summary": summary, "checks": checks, "runs": runs, "log_dir": str(log_dir),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
