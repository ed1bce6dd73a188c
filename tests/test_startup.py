"""Start-up mistakes print one clear line and exit non-zero (no traceback unless --log-level debug);
``import dflash_core`` sets OMP_WAIT_POLICY=PASSIVE for every entry point."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.settings import Settings
from server.state import ServerState
from tests.helpers import make_tiny_pair
from tests.server_fixtures import REPO, start_server


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft) where the draft's vocabulary does not match the target's."""
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("startup"))
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] = 999
    (draft / "config.json").write_text(json.dumps(config))
    return target, draft


def run_to_exit(args: list[str], log: Path) -> tuple[int, list[str]]:
    server = start_server(args, log)
    try:
        code = server.proc.wait(timeout=300)
    finally:
        server.terminate()
    return code, log.read_text(errors="replace").splitlines()


def assert_one_clear_error(code: int, lines: list[str], *words: str) -> None:
    text = "\n".join(lines)
    assert code == 1, text
    assert "Traceback" not in text, text
    errors = [line for line in lines if " ERROR " in line]
    assert len(errors) == 1, text
    assert all(w in errors[0] for w in words), errors[0]


def test_missing_target_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "model"
    code, lines = run_to_exit(["--target", str(missing), "--device", "cpu"], tmp_path / "log")
    assert_one_clear_error(code, lines, "--target", str(missing), "no such folder")
    assert not any("Uvicorn running" in line for line in lines)  # found before the server started


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(tmp_path: Path) -> None:
    code, lines = run_to_exit(["--device", "cuda"], tmp_path / "log")
    assert_one_clear_error(code, lines, "--device cuda", "CUDA is not available")
    assert not any("Uvicorn running" in line for line in lines)


def test_gpu_memory_utilization_without_cuda(tmp_path: Path) -> None:
    code, lines = run_to_exit(["--device", "cpu", "--gpu-memory-utilization", "0.5"], tmp_path / "log")
    assert_one_clear_error(code, lines, "--gpu-memory-utilization", "on cpu use --kv-cache-memory")
    assert not any("Uvicorn running" in line for line in lines)  # found before the models load


def test_mismatched_draft(pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = pair
    code, lines = run_to_exit(["--target", str(target), "--draft", str(draft), "--device", "cpu"], tmp_path / "log")
    assert_one_clear_error(code, lines, "loading the models failed", "vocab_size")


def test_bad_setting_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "server", "--port", "eighty"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "dflash-serve: error: flag --port: 'port' must be an integer, got 'eighty'"
    ]


@pytest.mark.parametrize(
    ("args", "config", "message"),
    [
        (["--frobnicate"], None, "unrecognized arguments: --frobnicate"),
        (["--port"], None, "argument --port: expected one argument"),
        (["--config", "{c}"], "port: [\n", "malformed YAML"),
        (["--kv-block-size", "24"], None, "kv_block_size must be a power of two in 1..256, got 24"),
        (["--max-num-seqs", "0"], None, "max_running_requests must be >= 1"),
        (["--enable-prefix-caching=no"], None, "ignored explicit argument"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    args: list[str], config: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from server.__main__ import main

    path = tmp_path / "c.yaml"
    if config is not None:
        path.write_text(config)
    assert main([a.format(c=path) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash-serve: error: ") and message in err[0], err


def test_help_is_still_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from server.settings import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0 and "--sse-ping-interval" in capsys.readouterr().out


def test_log_json_from_the_yaml_config_applies_to_setting_errors(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("log_json: true\nport: eighty\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    for args, extra in ((["--config", str(config)], {}), ([], {"DFLASH_CONFIG": str(config)})):
        out = subprocess.run([sys.executable, "-m", "server", *args], cwd=REPO, env=env | extra,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        (line,) = out.stderr.strip().splitlines()
        assert json.loads(line)["level"] == "ERROR" and "eighty" in line


@pytest.mark.parametrize("level", ["info", "debug"])
def test_load_failure_traceback_only_at_debug(
    pair: tuple[Path, Path], level: str, caplog: pytest.LogCaptureFixture
) -> None:
    target, draft = pair
    errors: list[str] = []
    caplog.set_level(getattr(logging, level.upper()))
    ServerState(Settings(target=str(target), draft=str(draft), device="cpu")).load(errors.append)
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "vocab_size" in record.getMessage() and "\n" not in record.getMessage()
    assert bool(record.exc_info) == (level == "debug")
    assert errors and "vocab_size" in errors[0]


# --- OMP_WAIT_POLICY -----------------------------------------------------------------------------------------


def omp_policy(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport os; print(os.environ.get('OMP_WAIT_POLICY'))"],
        cwd=REPO, env=full, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def test_importing_dflash_core_sets_passive_before_torch() -> None:
    assert omp_policy("import dflash_core") == "PASSIVE"
    assert omp_policy("import dflash_core.train") == "PASSIVE"  # dflash-train's module
    assert omp_policy("import dflash_core", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"  # an explicit choice is kept
    assert omp_policy("import torch, dflash_core") == "None"  # too late to matter: left alone


def test_dflash_serve_gets_the_policy_from_dflash_core() -> None:
    assert omp_policy("import server.__main__") == "PASSIVE"
