"""dflash-bench on a tiny pair: offline in-process, serve against real dflash servers on 127.0.0.1.

Both modes must write JSON that validates against `BENCH_SCHEMA` and valid PNG plots; offline greedy outputs
must be identical; the shipped prompt sets must be well-formed and disjoint from the demo's held-out set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from dflash_core import bench
from dflash_core.bench import serve as bench_serve
from tests.helpers import make_tiny_pair
from tests.server_fixtures import REPO, ServerProcess, free_port, start_server

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
    # fixed widths: the random draft is never right, so the adaptive policy would soon stop drafting
    srv = start_server(["--target", str(target), "--draft", str(draft), "--device", "cpu", "--speculation", "fixed"],
                       log, env)
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
            "--speculation",
            "fixed",  # drafts every step, whatever the machine's load (the histogram below needs drafts)
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
        "--repeats",
        "2",
        "--min-duration",
        "0",
    ]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "TTFT p50/90/99 ms" in out and "round tok/s min-max" in out and "at least 2 rounds" in out
    data = load_valid(tmp_path / "serve_dflash.json", bench.SERVE_SCHEMA)
    assert data["label"] == "dflash" and data["server"]["dflash"]["block_size"] == 16
    assert data["config"]["repeats"] == 2 and data["config"]["min_duration_s"] == 0
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        # two rounds of the same 3 requests
        assert lv["repeats"] == len(lv["rounds"]) == 2
        assert lv["completed"] == lv["num_requests"] == 6 and lv["failed"] == 0 and lv["errors"] == []
        assert [r["completed"] for r in lv["rounds"]] == [3, 3]
        assert lv["output_tokens"] == sum(r["output_tokens"] for r in lv["rounds"]) > 0
        assert lv["duration_s"] == pytest.approx(sum(r["duration_s"] for r in lv["rounds"]))
        assert lv["output_tokens_per_s"] > 0 and lv["request_throughput"] > 0
        tps = lv["spread"]["output_tokens_per_s"]
        assert tps["min"] <= lv["output_tokens_per_s"] <= tps["max"] and tps["stdev"] is not None
        assert 0 < lv["ttft_s"]["p50"] <= lv["e2e_latency_s"]["p99"]
        spec = lv["dflash"]
        assert spec["num_drafts"] > 0
        # vLLM's definition, from the level's own counters (not merely ">= 1")
        assert lv["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
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
            "--repeats",
            "1",
            "--min-duration",
            "0.5",
        ]
    )
    assert rc == 0
    assert "spec vs baseline" in capsys.readouterr().out
    spec = load_valid(cmp_dir / "serve_spec.json", bench.SERVE_SCHEMA)
    (lv,) = spec["levels"]  # one round would take well under 0.5 s: the level runs rounds until 0.5 s
    assert lv["duration_s"] >= 0.5 and lv["repeats"] == len(lv["rounds"]) and lv["num_requests"] == 2 * lv["repeats"]
    cmp = spec["comparison"]
    assert cmp["baseline_label"] == "baseline" and [c["concurrency"] for c in cmp["levels"]] == [1]
    assert cmp["levels"][0]["output_throughput_speedup"] > 0
    check_png(cmp_dir / "serve_spec_throughput.png")


def test_level_spread_and_table() -> None:
    def req(tokens: int) -> dict:
        return {"ok": True, "tokens": tokens, "ttft": 0.01, "e2e": 0.1, "itl": [0.01], "tpot": 0.01, "spec": None,
                "text": f"t{tokens}"}

    rounds = [bench_serve._round_result([req(10), req(10)], 1.0), bench_serve._round_result([req(10), req(10)], 0.5)]
    lv = bench_serve._level_result(2, [req(10)] * 4, 1.5, rounds)
    assert lv["repeats"] == 2 and lv["output_tokens_per_s"] == pytest.approx(40 / 1.5)
    assert lv["spread"]["output_tokens_per_s"] == pytest.approx({"min": 20.0, "max": 40.0, "stdev": 14.142135})
    assert lv["spread"]["request_throughput"]["min"] == 2.0
    assert bench.spread([5.0]) == {"min": 5.0, "max": 5.0, "stdev": None}
    result = {
        "label": "x",
        "config": {"base_url": "u", "model": "m", "dataset": "d", "max_tokens": 8, "temperature": 0.0,
                   "repeats": 2, "min_duration_s": 10.0},
        "levels": [lv],
    }
    table = bench.format_serve(result)
    assert "rounds" in table and "20-40" in table and "14.1" in table and "at least 2 rounds and 10 s" in table


def test_serve_defaults_run_levels_long_enough() -> None:
    args = bench.build_parser().parse_args(["serve", "--base-url", "http://x/v1"])
    assert args.repeats >= 3 and args.min_duration >= 10


def test_compare_rejects_old_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema_version": 1, "mode": "serve", "levels": []}))
    url = f"http://127.0.0.1:{free_port()}/v1"
    rc = bench.main(["serve", "--base-url", url, "--output-dir", str(tmp_path), "--compare", str(old)])
    assert rc == 2 and "rerun the baseline" in capsys.readouterr().err


def test_help_lists_modes_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    parser = bench.build_parser()
    text = parser.format_help()
    lines = text.splitlines()
    modes = ("offline", "serve", "stall", "memory")
    for mode in modes:
        (i,) = [i for i, line in enumerate(lines) if line.strip().startswith(mode + " ")]
        assert lines[i + 1].strip() == "" or lines[i + 1].lstrip().split()[0] in modes, f"the {mode} line wraps"
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        fmt = sp._get_formatter()
        for action in sp._actions:
            if not action.option_strings or action.required or action.nargs == 0:
                continue
            assert "default" in fmt._get_help_string(action), f"{name} {action.option_strings}: no default shown"
    assert "(default: 3)" in sub.choices["serve"].format_help()


def test_memory_estimate_of_presets(capsys: pytest.CaptureFixture[str]) -> None:
    from dflash_core.memory import GIB, cuda_cache_budget

    est = bench.memory_from_preset(REPO / "configs" / "qwen3-8b.yaml")
    assert est["max_running_requests"] == 256 and est["max_model_len"] == 8192 and est["kv_block_size"] == 16
    assert est["target_kv_bytes_per_token"] == 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads x 128, bf16
    assert est["draft_kv_bytes_per_token"] == 2 * 5 * 8 * 128 * 2  # the draft's pages share the target's blocks
    # published sizes: Qwen3-8B 8.19 B parameters, its DFlash draft about 1 B
    assert est["target_params"] / 1e9 == pytest.approx(8.19, abs=0.01)
    assert est["draft_params"] / 1e9 == pytest.approx(1.05, abs=0.01)
    # an 80 GB card at --gpu-memory-utilization 0.9: less the weights, the 2 GiB reserve, the widest step's logits
    card = est["cards"]["80 GB"]
    budget = cuda_cache_budget(0.9, 80 * GIB, est["weights_bytes"], 2048 * 151936 * 4)
    blocks = budget // (16 * (147456 + 20480))
    assert card["cache_budget"] == budget and card["num_blocks"] == blocks and card["pool_tokens"] == (blocks - 1) * 16
    assert card["pool_tokens"] == 330_096 and card["requests_full"] == (blocks - 1) // 514 == 40  # 514 = (8192+17)/16
    assert card["requests_short"] == 158 and card["running"] == 256
    assert not est["cards"]["24 GB"]["fits"]  # not one request of 8,192 beside 18.5 GB of weights at 0.9
    small = bench.memory_from_preset(REPO / "configs" / "qwen3-4b.yaml")
    assert small["target_params"] / 1e9 == pytest.approx(4.02, abs=0.01)  # tied embeddings
    presets = [str(REPO / "configs" / n) for n in ("qwen3-4b.yaml", "qwen3-8b.yaml", "llama3.1-8b.yaml")]
    assert bench.main(["memory", *presets]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| preset |") and table.count("\n| `") == 3
    assert "| 168 KB | 7,840 tokens: < 1 x 8,192 | " in table and "330,096 tokens: 40 x 8,192, 158 x 2,048" in table
    assert bench.main(["memory", str(REPO / "configs" / "demo.yaml")]) == 2


def test_memory_estimate_matches_real_models_and_caches(pair: tuple[Path, Path]) -> None:
    """Parameter counts and the KV pool against what the loader really allocates for a local pair."""
    import torch

    from dflash_core.config import EngineConfig
    from dflash_core.loading import load_models

    target, draft = pair
    budget = 3 << 20
    est = bench.memory_estimate(str(target), str(draft), dtype="float32", max_model_len=64, max_running_requests=3,
                                kv_cache_memory=budget)
    models = load_models(EngineConfig(str(target), str(draft), device="cpu", dtype="float32", max_model_len=64,
                         max_running_requests=3, backend="native", kv_cache_memory=str(budget)))
    engine = models.engine

    def params(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    assert est["target_params"] == params(engine.target.model)
    assert est["draft_params"] == params(engine.drafter.draft)
    assert est["num_blocks"] == engine.target.num_blocks == models.memory.num_blocks
    assert est["target_kv_bytes"] == engine.target.kv_bytes_per_block * engine.target.num_blocks
    assert est["draft_kv_bytes"] == engine.drafter.draft_bytes_per_block * engine.target.num_blocks


def test_memory_estimate_of_hybrid_and_moe_presets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3.5 / Qwen3.6 (hybrid) and gpt-oss (MoE) presets: parameters as transformers counts them, KV for
    full-attention layers only plus the Gated DeltaNet state per running request; a tiny hybrid's estimate is what
    the runner allocates."""

    from dflash_core.config import EngineConfig
    from dflash_core.loading import load_models

    est = bench.memory_from_preset(REPO / "configs" / "qwen3.5-9b.yaml")
    assert est["target_params"] == 8_953_803_264  # Qwen3_5ForCausalLM of the published text config, meta device
    assert est["target_kv_bytes_per_token"] == 2 * 8 * 4 * 256 * 2  # 8 of 32 layers keep K and V
    # one state copy: 24 DeltaNet layers x (window of 3 inputs x 8192 bf16 channels + 32 x 128 x 128 float32)
    one = 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    # per running request: live + rollback copy, and with prefix caching (the preset's) up to 4 checkpoint copies
    # (2 marks, the pending boundary state, the deferred checkpoint); the store: max(4, running // 2) checkpoints
    assert est["enable_prefix_caching"] and est["checkpoint_bytes"] == one and est["request_checkpoints"] == 4
    # and the rollback records of a block-wide verify (16 tokens): per layer and token the convolution input (8192
    # bf16 channels) and the key, value, decay and beta of each of the 32 value heads (float32)
    records = 16 * 24 * (8192 * 2 + 32 * (128 + 128 + 2) * 4)
    assert est["record_bytes_per_request"] == records
    assert est["state_bytes_per_request"] == (2 + 4) * one + records
    card = est["cards"]["48 GB"]  # states and store take at most half of the budget: fewer than 256 run

    def running(budget: int, per_request: int, store: bool) -> int:  # the largest cap whose states fit half
        return max(n for n in range(1, 257) if n * per_request + (max(4, n // 2) * one if store else 0)
                   <= budget // 2)

    assert card["fits"] and card["running"] == running(card["cache_budget"], 6 * one + records, True) < 256
    assert card["target_state_bytes"] == card["running"] * (6 * one + records)
    assert card["checkpoint_store_count"] == max(4, card["running"] // 2)
    assert card["checkpoint_store_bytes"] == card["checkpoint_store_count"] * one
    assert card["num_blocks"] == ((card["cache_budget"] - card["target_state_bytes"] - card["checkpoint_store_bytes"])
                                  // (16 * (est["target_kv_bytes_per_token"] + est["draft_kv_bytes_per_token"])))
    # --no-enable-prefix-caching: live + rollback copy only, no store
    off = bench.memory_estimate("Qwen/Qwen3.5-9B", "z-lab/Qwen3.5-9B-DFlash", max_model_len=8192,
                                enable_prefix_caching=False)
    off_card = off["cards"]["48 GB"]
    assert off["state_bytes_per_request"] == 2 * one + records and off["request_checkpoints"] == 0
    assert off_card["running"] == running(off_card["cache_budget"], 2 * one + records, False) > card["running"]
    assert off_card["target_state_bytes"] == off_card["running"] * (2 * one + records)
    assert off_card["checkpoint_store_bytes"] == off_card["checkpoint_store_count"] == 0
    assert not est["cards"]["24 GB"]["fits"] and est["cards"]["24 GB"]["why"] == "weights"
    assert bench.memory_from_preset(REPO / "configs" / "qwen3.5-27b.yaml")["target_params"] == 26_895_998_464
    oss = bench.memory_from_preset(REPO / "configs" / "gpt-oss-20b.yaml")
    assert oss["target_params"] == 20_914_757_184 and oss["state_bytes_per_request"] == 0  # every expert resident
    assert oss["backend"] == "generic" and oss["cards"]["80 GB"]["fits"]
    for preset, params, kv in (("gemma-4-31b.yaml", 30.70, 901_120), ("gemma-4-26b-a4b.yaml", 25.23, 225_280)):
        gemma = bench.memory_from_preset(REPO / "configs" / preset)  # the published 30.7 B and 25.2 B
        assert round(gemma["target_params"] / 1e9, 2) == params and gemma["target_kv_bytes_per_token"] == kv
        assert gemma["backend"] == "generic" and gemma["cards"]["H200 141 GB"]["fits"]
    big = bench.memory_from_preset(REPO / "configs" / "gpt-oss-120b.yaml")  # MXFP4 experts: one 80 GB card
    assert round(big["target_params"] / 1e9, 1) == 116.8 and big["cards"]["80 GB"]["fits"]
    assert big["quantization"] == "mxfp4" and round(big["weights_bytes"] / 1e9, 1) == 65.9
    assert not big["cards"]["48 GB"]["fits"] and big["cards"]["48 GB"]["why"] == "weights"
    presets = [str(REPO / "configs" / n) for n in ("qwen3.5-9b.yaml", "qwen3.5-27b.yaml", "qwen3.6-27b.yaml",
                                                   "gpt-oss-20b.yaml")]
    assert bench.main(["memory", *presets]) == 0
    out = capsys.readouterr().out
    assert out.count("\n| `") == 4 and "running: recurrent state)" in out

    target, draft = make_tiny_pair(tmp_path, "qwen3_5")
    budget = 3 << 20
    for prefix in (True, False):
        est = bench.memory_estimate(str(target), str(draft), dtype="float32", max_model_len=64,
                                    max_running_requests=3, kv_cache_memory=budget, enable_prefix_caching=prefix)
        engine = load_models(EngineConfig(str(target), str(draft), device="cpu", dtype="float32", max_model_len=64,
                                          max_running_requests=3, backend="native", kv_cache_memory=str(budget),
                                          enable_prefix_caching=prefix)).engine
        runner = engine.target
        allocated = allocated_bytes(runner)  # the pages, and each slot's live and rollback states
        assert est["target_params"] == sum(p.numel() for p in runner.model.parameters())
        assert est["num_blocks"] == runner.num_blocks and est["running"] == runner.max_slots == 3
        assert est["checkpoint_bytes"] == runner.checkpoint_bytes
        assert est["target_kv_bytes"] + 3 * 2 * runner.checkpoint_bytes == allocated
        # beyond the allocation: each request's checkpoint copies, and the store's limit (the runner's own)
        # (and a block-wide verify's rollback records, which tests/test_hybrid_prefix.py holds the engine to)
        records = est["record_bytes_per_request"]
        assert est["target_state_bytes"] == 3 * ((2 + (4 if prefix else 0)) * runner.checkpoint_bytes + records)
        store = engine.kv.checkpoints
        assert (store is not None) == prefix == runner.checkpointing
        assert est["checkpoint_store_bytes"] == (runner.checkpoint_limits[1] if prefix else 0)
        assert store is None or (store.max_count, store.max_bytes) == runner.checkpoint_limits == (
            est["checkpoint_store_count"], est["checkpoint_store_bytes"])


def _clean_env(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    monkeypatch.delenv(bench.BENCH_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(home))


def test_output_dir_default_and_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch, tmp_path / "home")
    monkeypatch.chdir(tmp_path)
    assert bench.resolve_output_dir(None) == Path("bench-results") and (tmp_path / "bench-results").is_dir()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(bench.BENCH_DIR_ENV, str(tmp_path / "env" / "dir"))
    assert bench.resolve_output_dir(None) == tmp_path / "env" / "dir" and (tmp_path / "env" / "dir").is_dir()
    assert bench.resolve_output_dir(tmp_path / "flag") == tmp_path / "flag"  # --output-dir wins


def test_output_dir_falls_back_when_cwd_unusable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch, tmp_path / "home")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench-results").write_text("a file, not a folder")  # unusable even for root
    assert bench.resolve_output_dir(None) == tmp_path / "home" / "bench-results"
    err = capsys.readouterr().err
    assert "bench-results is not writable" in err and f"writing results to {tmp_path / 'home'}" in err


@pytest.mark.parametrize("how", ["flag", "env"])
def test_unwritable_output_dir_is_a_clear_error(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch, tmp_path / "home")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    args = ["serve", "--base-url", f"http://127.0.0.1:{free_port()}/v1", "--no-progress"]
    if how == "flag":
        args += ["--output-dir", str(blocker / "out")]
    else:
        monkeypatch.setenv(bench.BENCH_DIR_ENV, str(blocker / "out"))
    assert bench.main(args) == 2
    err = capsys.readouterr().err
    # checked before anything is measured: the error names the folder, not the unreachable server
    assert f"output folder {blocker / 'out'}" in err and "not writable" in err and "cannot list models" not in err


def _python_for(user: int | None) -> str | None:
    """An interpreter `user` can run that imports dflash_core.bench from the checkout: ours, else the system's
    (bench's command line and output folder need only the standard library)."""
    kwargs = {} if user is None else {"user": user, "group": user, "extra_groups": []}
    for exe in (sys.executable, "/usr/bin/python3"):
        try:
            res = subprocess.run([exe, "-c", "import sys; assert sys.version_info >= (3, 11)"], cwd="/",
                                 capture_output=True, timeout=60, **kwargs)
        except OSError:  # e.g. a venv whose base interpreter is under /root
            continue
        if res.returncode == 0:
            return exe
    return None


def test_default_output_dir_as_container_user() -> None:
    """The image's case: uid 1000 in a root-owned working folder (/app) falls back to ~/bench-results."""
    user = 1000 if os.geteuid() == 0 else None
    exe = _python_for(user)
    if exe is None:
        pytest.skip("no Python 3.11+ interpreter that uid 1000 can run")
    base = Path(tempfile.mkdtemp(prefix="dflash-bench-uid-"))  # not under pytest's 0700 tmp: uid 1000 reads it
    app, home = base / "app", base / "home"
    try:
        base.chmod(0o755)
        app.mkdir(mode=0o755)
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if k != bench.BENCH_DIR_ENV}
        env.update(HOME=str(home), PYTHONPATH=str(REPO))
        kwargs: dict = {}
        if user is not None:
            os.chown(home, user, user)
            kwargs = {"user": user, "group": user, "extra_groups": []}
        else:
            app.chmod(0o555)
        res = subprocess.run(
            [exe, "-m", "dflash_core.bench", "offline", "--dataset", str(base / "missing.jsonl"), "--no-progress"],
            cwd=app, env=env, capture_output=True, text=True, timeout=120, **kwargs,
        )
        # exit 2 for the missing dataset, after choosing the output folder
        assert res.returncode == 2 and "unknown dataset" in res.stderr, res.stderr
        assert "PermissionError" not in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert f"writing results to {home / 'bench-results'}" in res.stderr, res.stderr
        assert (home / "bench-results").is_dir() and not (app / "bench-results").exists()
    finally:
        if app.exists():
            app.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


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
    assert bench_serve._itl_samples([0.1, 0.3, 0.4, 0.8], 8) == pytest.approx([0.1, 0.05, 0.2])
    assert bench_serve._itl_samples([0.1], 1) == []


def test_identity_error_names_prompt_and_position() -> None:
    err = bench.IdentityError(5, 2, [1, 2, 3, 4], [1, 2, 9, 4])
    assert err.code == 3 and "prompt 5" in str(err) and "position 2" in str(err)


def test_missing_bench_extra_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the `bench` extra (openai, matplotlib) a mode that needs it stops with one line naming the extra."""
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` raises ImportError
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert bench.main(["serve", "--base-url", url, "--output-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "openai" in err and 'pip install "dflash-serve[bench]"' in err, err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert bench.main(["offline", "--output-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib" in err and "openai" not in err and "[bench]" in err, err


def test_prompt_file_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", '
                    '"content": "a reference answer"}]}\n')
    a, b = bench.load_prompts(str(path), None)
    assert a.messages == [{"role": "user", "content": "hi"}] and a.source == "p"
    assert b.messages == [{"role": "user", "content": "q"}]  # the trailing assistant message is dropped
    path.write_text('{"prompt": "hi"}\n\n{"text": "no prompt"}\n')
    expected = f"{path}:3: expected 'messages', 'prompt', 'turns' or 'prompt_token_ids'"
    with pytest.raises(bench.BenchError, match=expected):
        bench.load_prompts(str(path), None)
    path.write_text('{"prompt": "hi"}\n\nnot json\n')
    with pytest.raises(bench.BenchError, match=f"{path}:3: not valid JSON"):
        bench.load_prompts(str(path), None)


def test_tokenizer_without_chat_template_is_refused() -> None:
    from dflash_core.bench.offline import encode_prompt

    class Plain:
        chat_template = None

    with pytest.raises(bench.BenchError, match="no chat template"):
        encode_prompt(Plain(), [{"role": "user", "content": "hi"}])


def test_stall_runs_against_a_server(server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dflash-bench stall`: running streams, a long prompt, and the gap figures in the report and the JSON."""
    server.wait_ready(SERVER_START_TIMEOUT_S)
    rc = bench.main(["stall", "--base-url", server.url + "/v1", "--streams", "2", "--prompt-tokens", "300",
                     "--max-tokens", "48", "--output-dir", str(tmp_path)])
    assert rc == 0
    assert "largest gap during the prefill" in capsys.readouterr().out
    data = json.loads((tmp_path / "stall.json").read_text())
    assert data["mode"] == "stall" and data["streams"] == 2 and data["gaps_during_prefill"] > 0
    assert abs(data["long_prompt_tokens"] - 300) <= 30  # sized from the server's own token counts
    assert data["median_gap_s"] > 0 and data["stall_ratio"] == data["max_gap_during_prefill_s"] / data["median_gap_s"]


def allocated_bytes(obj: object) -> int:
    """Bytes of the tensors an object holds as attributes, directly or in lists (one cache tensor per layer)."""
    import torch

    total = 0
    for value in vars(obj).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        total += sum(t.nbytes for t in items if isinstance(t, torch.Tensor))
    return total


# ---- the paged KV cache's modes: prefix, capacity, serve --shared-prefix-tokens ----
def test_kv_modes_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """prefix and capacity parse with their defaults; serve takes --shared-prefix-tokens; bad values are refused."""
    parser = bench.build_parser()
    a = parser.parse_args(["prefix"])
    assert (a.turns, a.system_tokens, a.max_tokens, a.kv_block_size, a.target, a.temperature) == (6, 1000, 64, 16,
                                                                                                  None, 0.0)
    c = parser.parse_args(["capacity", "--slots", "3", "--preempt-blocks", "20"])
    assert (c.slots, c.max_len, c.num_requests, c.max_tokens, c.preempt_requests, c.preempt_blocks) == (3, 1024, 48,
                                                                                                        16, 6, 20)
    s = parser.parse_args(["serve", "--base-url", "http://x/v1", "--shared-prefix-tokens", "500"])
    assert s.shared_prefix_tokens == 500
    assert parser.parse_args(["serve", "--base-url", "http://x/v1"]).shared_prefix_tokens == 0
    assert bench.main(["prefix", "--turns", "0"]) == 2 and bench.main(["capacity", "--slots", "0"]) == 2
    with pytest.raises(SystemExit):
        bench.main(["serve", "--base-url", "http://x/v1", "--shared-prefix-tokens", "-1"])
    capsys.readouterr()


def test_prefix_counters_from_metrics_text() -> None:
    """The hit rate comes from the server's counters (vLLM's names or dflash's), summed over label sets."""
    text = ("# HELP vllm:prefix_cache_hits_total x\nvllm:prefix_cache_hits_total{model_name=\"m\"} 30.0\n"
            "vllm:prefix_cache_queries_total{model_name=\"m\"} 40.0\nvllm:prefix_cache_queries_total{a=\"b\"} 10\n")
    assert bench_serve.parse_prefix_counters(text) == {"hits": 30.0, "queries": 50.0}
    assert bench_serve.parse_prefix_counters("dflash_prefix_cache_hits_total 1\ndflash_prefix_cache_queries 2\n") == {
        "hits": 1.0, "queries": 2.0}
    assert bench_serve.parse_prefix_counters("dflash_requests_total 3\n") is None
    assert bench_serve.prefix_delta({"hits": 10, "queries": 20}, {"hits": 40, "queries": 60})["hit_rate"] == 0.75
    assert bench_serve.prefix_delta(None, {"hits": 1, "queries": 1})["hit_rate"] is None
    assert bench_serve.metrics_url("http://h:1/v1/") == "http://h:1/metrics"
    p = bench_serve.with_prefix(bench.Prompt([{"role": "user", "content": "q"}], "chat"), "S")
    assert p.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]


def test_prefix_mode_tiny_pair(pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dflash-bench prefix`: from turn 2 on the previous turn comes from the cache; the text equals caching off."""
    target, draft = pair
    rc = bench.main(["prefix", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--turns", "3",
                     "--system-tokens", "100", "--max-tokens", "6", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "TTFT on ms" in out and "3/3 turns give the same text" in out
    data = json.loads((tmp_path / "prefix.json").read_text())
    assert data["mode"] == "prefix" and data["config"]["kv_block_size"] == 16
    s, turns = data["summary"], data["turns"]
    assert s["all_identical"] and s["identical_turns"] == 3 and len(turns) == 3
    assert turns[0]["prompt_tokens"] >= 100 and turns[0]["on_cached_tokens"] == 0
    for prev, t in zip(turns, turns[1:]):
        assert t["on_cached_tokens"] >= prev["prompt_tokens"] // 16 * 16 > 0 and t["off_cached_tokens"] == 0
        assert t["on_cached_tokens"] < t["prompt_tokens"]
    assert turns[0]["on_ttft_ratio"] == 1.0 and isinstance(s["meets_target"], bool)
    assert s["kv"]["on"]["prefix_hits"] >= s["later_cached_tokens"] and s["kv"]["off"]["prefix_hits"] == 0


def test_capacity_mode_tiny_pair(pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dflash-bench capacity`: the slot layout's blocks run many more short requests at once, exact; a tight pool
    preempts, and every request still completes with the roomy pool's output."""
    target, draft = pair
    rc = bench.main(["capacity", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--slots", "2",
                     "--max-len", "512", "--num-requests", "8", "--max-tokens", "4", "--preempt-requests", "4",
                     "--preempt-max-tokens", "24", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "peak running" in out and "preemptions" in out
    data = json.loads((tmp_path / "capacity.json").read_text())
    c, p = data["concurrency"], data["preemption"]
    assert data["mode"] == "capacity" and data["all_identical"]
    assert c["budget_blocks"] == 2 * 512 // 16 + 1 and c["slot_layout"]["peak_running"] == 2
    assert c["block_pool"]["peak_running"] >= 4 * 2 and c["concurrency_gain"] >= 4
    assert c["identical_outputs"] == c["slot_layout_identical"] == 8 and c["reference"] == "target alone"
    assert c["slot_layout"]["kv_bytes"] == c["block_pool"]["kv_bytes"]
    assert p["preemptions"] > 0 and p["completed"] == 4 and p["identical_to_roomy"] == 4
    assert p["identical_to_target_alone"] == 4 and p["roomy"]["kv"]["preemptions"] == 0


def test_profile_mode_tiny_pair(pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dflash-bench profile`: un-profiled totals of both engines, and a breakdown whose shares make up the step."""
    from dflash_core.bench.profile import CATEGORIES

    target, draft = pair
    rc = bench.main(["profile", "--target", str(target), "--draft", str(draft), "--prompts", "2", "--max-tokens", "8",
                     "--http-rounds", "1", "--output-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, out + err[-2000:]
    assert "ms / step" in out and "py: engine rest" in out and "profiler inflates" in out
    assert "Serving paths" in out and "worker hand-off (ms/token)" in out and "http + sse (ms/token)" in out
    data = json.loads((tmp_path / "profile.json").read_text())
    assert data["mode"] == "profile" and data["config"]["speculation"] == "fixed"
    for name in ("plain", "dflash"):
        e = data[name]
        assert e["output_tokens"] == 16 and e["steps"] >= 2 and e["tokens_per_s"] > 0
        # the same requests in-process, through the worker thread and streamed from dflash-serve: every path's
        # text equals the in-process one (the mode checks it), so every path made the same tokens
        paths = e["paths"]
        assert set(paths) == {"in-process", "worker", "http", "worker_handoff_ms_per_token", "http_sse_ms_per_token"}
        assert all(paths[p]["tokens"] == 16 and paths[p]["tokens_per_s"] > 0 for p in ("in-process", "worker", "http"))
        assert paths["in-process"]["share_of_in_process"] == 1.0 and paths["http"]["share_of_in_process"] > 0
        share = e["profiled"]["share"]
        assert set(share) == set(CATEGORIES)
        assert all(v >= -0.02 for v in share.values()), share
        assert sum(share.values()) == pytest.approx(1.0, abs=0.03)
        # the target's products: PyTorch's matmuls, or the fused CPU step's C call (the default on a CPU)
        assert share["ops: matmul"] + share["ops: fused target (C)"] > 0 and share["py: target forward"] > 0
    assert data["plain"]["profiled"]["share"]["py: draft"] == 0 and data["dflash"]["profiled"]["share"]["py: draft"] > 0
    assert data["plain"]["steps"] == 16 and data["dflash"]["tokens_per_step"] >= 1


def test_serve_shared_prefix(server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --shared-prefix-tokens`: every prompt starts with the same system text, and each level reports the
    server's prefix-cache hit rate (null when its /metrics has no such counters)."""
    server.wait_ready(SERVER_START_TIMEOUT_S)
    rc = bench.main(["serve", "--base-url", server.url + "/v1", "--concurrency", "2", "--num-prompts", "3",
                     "--max-tokens", "4", "--repeats", "1", "--min-duration", "0", "--shared-prefix-tokens", "120",
                     "--output-dir", str(tmp_path), "--no-progress", "--no-plots"])
    assert rc == 0
    assert "prefix cache hit rate" in capsys.readouterr().out
    data = load_valid(tmp_path / "serve_dflash.json", bench.SERVE_SCHEMA)
    assert data["config"]["shared_prefix_tokens"] == 120
    assert abs(data["config"]["shared_prefix_prompt_tokens"] - 120) <= 30
    pc = data["levels"][0]["prefix_cache"]
    assert set(pc) == {"hits", "queries", "hit_rate"}
    if pc["hit_rate"] is not None:  # the server counts: the shared text is served from the cache
        assert pc["queries"] > 0 and 0 < pc["hit_rate"] <= 1
