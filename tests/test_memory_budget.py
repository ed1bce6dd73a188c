"""The start-up memory budget: sizes, the plan that sizes or checks max_model_len, its log line, and the one-line
refusal of a setting that cannot fit (from `load_models` and from `dflash-serve`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dflash_core.bench.memory import memory_estimate
from dflash_core.config import EngineConfig
from dflash_core.loading import load_models
from dflash_core.memory import SlotCosts, kv_bytes_per_row, parse_bytes, plan_memory
from tests.server_fixtures import start_server
from tests.test_startup import assert_one_clear_error, run_to_exit

# the bundled demo pair: 6 target layers x 2 KV heads x 64, a 2-layer draft (2 KV heads x 64), block 16, fp32
DEMO_ROW = 2 * 6 * 2 * 64 * 4
DEMO_DRAFT_ROW = 2 * 2 * 2 * 64 * 4


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("4GB") == 4_000_000_000 and parse_bytes("4G") == 4 << 30
    assert parse_bytes("512 MiB") == 512 << 20 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(4096) == parse_bytes("4096") == 4096
    for bad in ("4 parsecs", "", "-1GB", "0", True):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory="lots")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_cache_memory="1GB", gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_plan_sizes_an_unset_length_and_refuses_what_cannot_fit():
    costs = SlotCosts(target_row=1000, draft_row=100, state=5000, target_extra_rows=18, draft_extra_rows=18)
    assert costs.per_slot(1000) == 1000 * 1018 + 100 * 1018 + 5000
    assert costs.max_len_within(costs.per_slot(1000)) == 1000
    # unset max_model_len: the longest that fits 4 slots
    plan = plan_memory(costs, weights=10**9, slots=4, max_model_len=None, model_max_len=40960,
                       cache_budget=4 * costs.per_slot(2000) + 7, source="--kv-cache-memory X")
    assert plan.max_model_len == 2000 and plan.target_kv == 4 * 1000 * 2018 and plan.state == 20000
    assert plan.caches <= plan.cache_budget
    # capped at the model's own length
    assert plan_memory(costs, 0, 1, None, 512, 10**12, "x").max_model_len == 512
    # a given length that does not fit: what would
    with pytest.raises(ValueError) as err:
        plan_memory(costs, 0, 4, 32768, 40960, 4 * costs.per_slot(2000), "--kv-cache-memory 9MB")
    msg = str(err.value)
    assert "max_model_len 32,768 needs 36.1 MB per slot" in msg and "--kv-cache-memory 9MB" in msg
    assert "max_model_len <= 2,000 at 4 slots" in msg
    # no budget: as configured
    assert plan_memory(costs, 0, 8, 4096, 40960, None, "no budget set").target_kv == 8 * 1000 * (4096 + 18)


def test_bench_estimate_uses_the_same_row_arithmetic():
    est = memory_estimate("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", max_model_len=4096, max_running_requests=2)
    row = kv_bytes_per_row({"num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128}, 2)
    assert row == 147456 and est["target_kv_bytes"] == row * est["target_kv_rows"] * 2


def test_load_models_logs_the_budget_and_sizes_max_model_len(caplog):
    per_slot_1000 = DEMO_ROW * (1000 + 17) + DEMO_DRAFT_ROW * (1000 + 18)  # B + 1 target rows more, B + 2 draft
    with caplog.at_level(logging.INFO, logger="dflash.loading"):
        models = load_models(EngineConfig(max_running_requests=2, kv_cache_memory=str(2 * per_slot_1000)))
    assert models.memory is not None and models.memory.max_model_len == 1000
    assert models.engine.max_model_len == 1000
    assert models.memory.target_kv == 2 * DEMO_ROW * 1017 and models.memory.draft_kv == 2 * DEMO_DRAFT_ROW * 1018
    target, drafter = models.engine.target, models.engine.drafter
    assert models.memory.target_kv == target.kv_cache_bytes  # the plan is the allocation
    assert models.memory.draft_kv == drafter.slots.nbytes
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: "))
    assert "weights " in line and "target KV " in line and "2 slots x 1,000 tokens" in line and "draft KV" in line
    assert "cache budget (--kv-cache-memory" in line


def test_load_models_refuses_a_length_that_cannot_fit():
    with pytest.raises(ValueError, match=r"max_model_len 2,048 needs .* per slot.*fits max_model_len <= \d"):
        load_models(EngineConfig(max_running_requests=4, max_model_len=2048, kv_cache_memory="1MB"))
    with pytest.raises(ValueError, match="on cpu use --kv-cache-memory"):
        load_models(EngineConfig(device="cpu", gpu_memory_utilization=0.5))


def test_serve_logs_the_budget_and_refuses_in_one_line(tmp_path: Path):
    code, lines = run_to_exit(["--device", "cpu", "--max-model-len", "2048", "--kv-cache-memory", "1MB"],
                              tmp_path / "refused.log")
    assert_one_clear_error(code, lines, "loading the models failed", "--kv-cache-memory 1MB", "fits max_model_len <=")
    server = start_server(["--device", "cpu", "--kv-cache-memory", "64MiB"], tmp_path / "ok.log")
    try:
        server.wait_ready()
        assert "memory: weights" in server.log_tail() and "--kv-cache-memory 64MiB" in server.log_tail()
    finally:
        server.terminate()
