#!/usr/bin/env python3
"""How long `--compile` takes to make the engine ready: cold (an empty on-disk compile cache) and warm.

Each run is a fresh process that loads the bundled demo pair (or `--target` / `--draft`) with compile on, as
`dflash-serve --compile` does, and reports the seconds `load_models` took and the target's and draft's warm-up
(the compiles) within them, the CPU seconds of the whole process (with its compiler subprocesses: on a shared
machine a steadier figure than the wall clock), and the graphs dynamo compiled. Both runs use the same cache
directory (`TORCHINDUCTOR_CACHE_DIR`, and a temporary directory inside it for inductor's precompiled header): the
first finds it empty, the second finds what the first wrote.
Prints one JSON line.

    python scripts/compile_time.py                       # demo pair, CPU, a fresh temporary cache
    python scripts/compile_time.py --serve               # the same, timing `dflash-serve --compile` to /health 200
    python scripts/compile_time.py --cache-dir /var/cache/dflash --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

_CHILD = r"""
import json, logging, re, resource, sys, time
from dflash_core.config import EngineConfig
from dflash_core.loading import load_models

warm = []
class Grab(logging.Handler):
    def emit(self, record):
        m = re.search(r"static shapes .* in ([0-9.]+) s$", record.getMessage())
        if m:
            warm.append((record.name, float(m.group(1))))
h = Grab()
for name in ("dflash.native", "dflash.drafter"):
    logging.getLogger(name).addHandler(h)
    logging.getLogger(name).setLevel(logging.INFO)
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
load_models(EngineConfig(**args))
from torch._dynamo.utils import counters
cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
          for f in ("ru_utime", "ru_stime"))
print(json.dumps({"ready_s": round(time.perf_counter() - t0, 1), "cpu_s": round(cpu, 1),
                  "warm_up_s": {n: s for n, s in warm}, "graphs": counters["stats"]["unique_graphs"]}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--cache-dir", default=None, help="the compile cache (default: a fresh temporary directory)")
    p.add_argument("--runs", type=int, default=2, help="processes in a row over the same cache (first: cold)")
    p.add_argument("--serve", action="store_true",
                   help="time `dflash-serve --compile` itself: from the process start until GET /health answers 200")
    a = p.parse_args()
    cache = a.cache_dir or tempfile.mkdtemp(prefix="dflash-compile-")
    # inductor keeps its precompiled C++ header under the temporary directory, not the cache directory: a private
    # one per measurement, so that the cold run builds it as a fresh machine would
    tmp = os.path.join(cache, "tmp")
    os.makedirs(tmp, exist_ok=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TMPDIR": tmp}
    config = {"target": a.target, "draft": a.draft, "device": a.device, "compile": True,
              "max_running_requests": a.max_running_requests}
    results = []
    for _ in range(a.runs):
        if a.serve:
            results.append(_serve_ready(a, env))
            continue
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(config)], env=env, check=True,
                             capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(json.dumps({"cache_dir": cache, "cold": results[0], "warm": results[1:]}))


def _serve_ready(a: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    """Start `dflash-serve --compile` (the server's own entry point, on a free port of 127.0.0.1) and return the
    seconds until GET /health answers 200, and the CPU seconds the server used."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from server.__main__ import main; main()", "--compile", "--host", "127.0.0.1",
           "--port", str(port), "--device", a.device, "--max-num-seqs", str(a.max_running_requests)]
    if a.target:
        cmd += ["--target", a.target] + (["--draft", a.draft] if a.draft else [])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"dflash-serve exited with {server.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        ready = time.perf_counter() - t0
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
    return {"ready_s": round(ready, 1), "cpu_s": round(cpu, 1)}


if __name__ == "__main__":
    main()
