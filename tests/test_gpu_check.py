"""`scripts/gpu_check.sh --dry-run` runs the GPU check end to end on CPU with tiny shapes and writes its JSON; on a
machine without CUDA the real check exits 2 with a clear message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.server_fixtures import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def test_dry_run_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "gc"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] is True and result["tests"] is None
    cells = {(r["model"], r["kind"], r["batch"], r["width"]) for r in result["rows"]}
    for model in ("tiny-qwen3", "tiny-qwen3.5"):
        for b in (1, 2):
            assert {(model, "plain", b, 1), (model, "verify", b, 4), (model, "draft", b, 16)} <= cells
    assert all(r["ms"] > 0 and r["weights_bytes"] > 0 for r in result["rows"])
    assert set(result["anchors"]) == {"tiny-qwen3", "tiny-qwen3.5"}
    assert result["anchors"]["tiny-qwen3"]["plain_vs_bound"] > 0
    assert (out / "gpu_check.png").stat().st_size > 0  # matplotlib: the test extra
    assert "wrote" in proc.stdout and "plain step b1 vs weights/4.8 TB/s" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_exits_with_a_clear_message(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dflash_core.bench", "gpu-check", "--output-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "gpu-check needs a CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_script_is_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (Debian: apt-get install shellcheck; .ci/run installs it)")
    res = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout
