"""`scripts/gpu_check.sh --dry-run` runs the GPU check end to end on CPU with tiny shapes (the end-to-end server
part too) and writes its JSON; on a machine without CUDA the real check (and `--quick`) exits 2 with a clear
message."""

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
    assert all(r["ms"] > 0 and r["host_ms"] > 0 and r["weights_bytes"] > 0 for r in result["rows"])
    assert set(result["anchors"]) == {"tiny-qwen3", "tiny-qwen3.5"}
    assert result["anchors"]["tiny-qwen3"]["plain_vs_bound"] > 0
    assert result["anchors"]["tiny-qwen3"]["plain_host_ms"] > 0  # CPU: the call's wall time
    assert all(r["recompiles"] == 0 and r["syncs_per_call"] is None for r in result["rows"])  # eager, CPU
    assert (out / "gpu_check.png").stat().st_size > 0  # matplotlib: the test extra
    assert "wrote" in proc.stdout and "plain step b1 vs weights/4.8 TB/s" in proc.stdout
    assert "host time of a plain step b1" in proc.stdout
    # the end-to-end part: the server's app, scripted DFlash against --no-speculative at concurrency 1 and 2
    e2e = result["e2e"]
    assert e2e["model"] == "tiny-qwen3" and set(e2e["runs"]) == {"no-speculative", "dflash-scripted"}
    for name, rows in e2e["runs"].items():
        assert [r["concurrency"] for r in rows] == [1, 2]
        assert all(r["tokens"] == r["concurrency"] * e2e["max_tokens"] and r["tok_s"] > 0 for r in rows), name
    for r in e2e["runs"]["dflash-scripted"]:
        # the scripted drafter copies the recorded plain run at rate 0.8: several tokens per verify, not ~1
        assert r["draft_tokens"] > 0 and r["tokens_per_row_step"] > 2 and r["speedup"] > 0
    assert all(r["draft_tokens"] == 0 for r in e2e["runs"]["no-speculative"])
    assert "e2e c=1: DFlash (scripted" in proc.stdout
    # quantized linear layers: on a CPU no kernel is chosen, and each says why; the dequantizing forward is timed
    for name in ("block", "dynamic", "int8", "gptq-int4"):
        layer = result["quant"][name]
        why = "cpu: the kernel is CUDA's"
        assert layer["kernel"] is False and layer["reason"] == why and layer["dequant_ms_16"] > 0
        assert f"{name} 256x384: no kernel ({why})" in proc.stdout


def test_scripted_drafter_copies_the_recording_at_its_rate() -> None:
    from dflash_core.bench.gpu_e2e import ScriptedDrafter
    from dflash_core.runners.base import Drafter, DraftRequest, Proposal

    class Inner(Drafter):
        block_size, max_slots = 16, None

        def new_state(
            self, slot: int, prompt_token_ids: list[int], blocks: list[int] | None = None, cached: int = 0
        ) -> str:
            return "inner"

        def extend_context(self, state: object, features: object) -> None:
            pass

        def propose_batch(self, items: object) -> list[list[int]]:
            return [[7] * it.n for it in items]  # type: ignore[attr-defined]

    prompt, recorded = [1, 2, 3], list(range(100, 400))
    always = ScriptedDrafter(Inner(), {tuple(prompt): recorded}, 1.0, 1000)
    state = always.new_state(0, prompt)
    # position 3 holds recorded[0] (the first output token): the proposal starts at recorded[1]
    [prop] = always.propose_scored([DraftRequest(state, recorded[0], 3, 15)])
    assert prop == Proposal(recorded[1:16], [1.0] * 15)
    never = ScriptedDrafter(Inner(), {tuple(prompt): recorded}, 0.0, 1000)
    [prop] = never.propose_scored([DraftRequest(never.new_state(0, prompt), recorded[0], 3, 15)])
    assert all(t != r for t, r in zip(prop.tokens, recorded[1:16]))
    half = ScriptedDrafter(Inner(), {tuple(prompt): recorded}, 0.5, 1000)
    hits = [t == r for pos in range(3, 203, 15) for t, r in zip(
        half.propose_scored([DraftRequest(half.new_state(0, prompt), 0, pos, 15)])[0].tokens, recorded[pos - 2:])]
    assert 0.35 < sum(hits) / len(hits) < 0.65


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_exits_with_a_clear_message(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dflash_core.bench", "gpu-check", "--output-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "gpu-check needs a CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_quick_without_cuda_exits_with_a_clear_message(tmp_path: Path) -> None:
    """--quick with no .gpu-wheels folder says so and runs on the installed packages; without CUDA it exits 2."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    proc = subprocess.run(["bash", str(SCRIPT), "--quick", str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                                                        "GPU_WHEELS": str(tmp_path / "none")})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "gpu-check needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    assert "scripts/gpu_wheels.sh fills it" in proc.stderr


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_script_is_shellcheck_clean(script: str) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (Debian: apt-get install shellcheck; .ci/run installs it)")
    res = subprocess.run([shellcheck, str(SCRIPT.parent / script)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout
