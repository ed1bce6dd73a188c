"""dflash-bench on a tiny pair: offline in-process, serve against real dflash servers on 127.0.0.1.

Both modes must write JSON that validates against `BENCH_SCHEMA` and valid PNG plots; offline greedy outputs
must be identical; the shipped prompt sets must be well-formed and disjoint from the demo's held-out set.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from dflash_core import bench
from tests.helpers import make_tiny_pair
from tests.server_fixtures import ServerProcess, free_port, start_server

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SERVER_START_TIMEOUT_S = 90.0


def check_png(path: Path) -> None:
    """A real PNG image: magic bytes, and matplotlib reads it as a non-empty image."""
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, (path, img.shape)


def load_valid(path: Path, schema: dict) -> dict:
    data = json.loads(path.read_text())
    jsonschema.validate(data, bench.BENCH_SCHEMA)
    jsonschema.validate(data, schema)
    return data


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("bench_models"))


@pytest.fixture(scope="module")
def server(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A DFlash server on the tiny pair. Started, not awaited: its loading overlaps the offline test."""
    target, draft = pair
    log = tmp_path_factory.mktemp("bench_logs") / "server.log"
    # OpenMP's busy-wait makes torch 10-20x slower on a CPU shared with other test processes
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    srv = start_server(["--target", str(target), "--draft", str(draft), "--device", "cpu"], log, env)
    try:
        yield srv
    finally:
        srv.terminate(timeout_s=10)


def test_offline_tiny_pair(
    pair: tuple[Path, Path], server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    rc = bench.main(
        [
            "offline",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--num-prompts",
            "3",
            "--max-tokens",
            "8",
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "speedup (total time)" in out and "greedy outputs identical: 3/3" in out
    data = load_valid(tmp_path / "offline.json", bench.OFFLINE_SCHEMA)
    s = data["summary"]
    assert s["num_prompts"] == 3 and s["block_size"] == 16
    assert s["identity_checked"] and s["identical_outputs"] == 3
    assert len(s["acceptance_histogram"]["counts"]) == 16
    steps = sum(len(p["dflash"]["acceptance_lengths"]) for p in data["prompts"])
    assert (
        sum(s["acceptance_histogram"]["counts"])
        == steps
        == sum(p["dflash"]["num_drafts"] for p in data["prompts"])
    )
    assert sum(s["acceptance_histogram"]["fractions"]) == pytest.approx(1.0)
    assert s["plain"]["output_tokens"] == s["dflash"]["output_tokens"] > 0
    assert s["speedup"] == pytest.approx(s["plain"]["total_time_s"] / s["dflash"]["total_time_s"])
    assert [p["source"] for p in data["prompts"]] == ["chat", "math", "code"]
    for name in ("offline_speedup.png", "offline_acceptance.png"):
        check_png(tmp_path / name)


def test_serve_tiny_pair(server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server.wait_ready(SERVER_START_TIMEOUT_S)
    args = [
        "serve",
        "--base-url",
        server.url + "/v1",
        "--concurrency",
        "1,2",
        "--num-prompts",
        "3",
        "--max-tokens",
        "8",
        "--output-dir",
        str(tmp_path),
        "--no-progress",
    ]
    assert bench.main(args) == 0
    assert "TTFT p50/90/99 ms" in capsys.readouterr().out
    data = load_valid(tmp_path / "serve_dflash.json", bench.SERVE_SCHEMA)
    assert data["label"] == "dflash" and data["server"]["dflash"]["block_size"] == 16
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        assert lv["completed"] == lv["num_requests"] == 3 and lv["failed"] == 0 and lv["errors"] == []
        assert lv["output_tokens"] > 0 and lv["output_tokens_per_s"] > 0 and lv["request_throughput"] > 0
        assert 0 < lv["ttft_s"]["p50"] <= lv["e2e_latency_s"]["p99"]
        assert lv["dflash"]["num_drafts"] > 0 and lv["mean_acceptance_length"] >= 1.0
    for name in ("serve_dflash_throughput.png", "serve_dflash_latency.png"):
        check_png(tmp_path / name)

    # --compare with an earlier serve JSON (this run, relabelled); only the shared level 1 is compared
    base_json = tmp_path / "base.json"
    base_json.write_text(json.dumps({**data, "label": "baseline"}))
    cmp_dir = tmp_path / "cmp"
    rc = bench.main(
        [
            "serve",
            "--base-url",
            server.url + "/v1",
            "--concurrency",
            "1",
            "--num-prompts",
            "2",
            "--max-tokens",
            "8",
            "--output-dir",
            str(cmp_dir),
            "--no-progress",
            "--label",
            "spec",
            "--compare",
            str(base_json),
        ]
    )
    assert rc == 0
    assert "spec vs baseline" in capsys.readouterr().out
    cmp = load_valid(cmp_dir / "serve_spec.json", bench.SERVE_SCHEMA)["comparison"]
    assert cmp["baseline_label"] == "baseline" and [c["concurrency"] for c in cmp["levels"]] == [1]
    assert cmp["levels"][0]["output_throughput_speedup"] > 0
    check_png(cmp_dir / "serve_spec_throughput.png")


def test_serve_unreachable_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert bench.main(["serve", "--base-url", url, "--output-dir", str(tmp_path), "--no-progress"]) == 2
    assert "cannot list models" in capsys.readouterr().err


def test_shipped_prompt_sets() -> None:
    heldout = {p.messages[0]["content"] for p in bench.load_prompts("heldout", None)}
    seen: set[str] = set()
    for name in bench.SHIPPED_SETS:
        prompts = bench.load_prompts(name, None)
        texts = [p.messages[-1]["content"] for p in prompts]
        assert len(prompts) == 32 and len(set(texts)) == 32, name
        assert all(p.messages[-1]["role"] == "user" and p.source == name for p in prompts)
        assert not set(texts) & heldout, f"{name} overlaps the demo's held-out set"
        assert not set(texts) & seen
        seen.update(texts)
    mixed = bench.load_prompts("all", 7)
    assert [p.source for p in mixed] == ["chat", "math", "code"] * 2 + ["chat"]
    assert len(bench.load_prompts("code", 40)) == 40  # cycled


def test_download_dataset_without_datasets_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    rc = bench.main(["offline", "--dataset", "gsm8k", "--output-dir", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "network access" in err and "pip install datasets" in err and "chat, math, code" in err


def test_distribution_and_itl_split() -> None:
    assert bench.distribution([4.0, 1.0, 3.0, 2.0]) == {"mean": 2.5, "p50": 2.0, "p90": 4.0, "p99": 4.0}
    xs = list(range(1, 101))
    assert bench.distribution(xs) == {"mean": 50.5, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert bench.distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    # 8 tokens over 4 chunks: each gap is shared by 2 tokens
    assert bench._itl_samples([0.1, 0.3, 0.4, 0.8], 8) == pytest.approx([0.1, 0.05, 0.2])
    assert bench._itl_samples([0.1], 1) == []


def test_identity_error_names_prompt_and_position() -> None:
    err = bench.IdentityError(5, 2, [1, 2, 3, 4], [1, 2, 9, 4])
    assert err.code == 3 and "prompt 5" in str(err) and "position 2" in str(err)
