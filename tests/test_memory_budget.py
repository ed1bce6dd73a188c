"""The start-up memory plan in KV-pool terms: sizes, the pool a budget buys, the one-request rule (an unset
max_model_len lowered to fit, a set one refused in one line that says what would), a hybrid's recurrent states
counted first, the CPU default budget, its log line (from `load_models` and from `dflash-serve`)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from dflash_core.bench.memory import memory_estimate
from dflash_core.config import EngineConfig
from dflash_core.loading import (
    MAX_STATIC_BATCH,
    load_models,
    longest_allowed,
    max_positions,
    memory_budget,
    static_shapes,
)
from dflash_core.memory import (
    GIB,
    RAM_KV_DEFAULT_CAP,
    PoolCosts,
    kv_bytes_per_row,
    parse_bytes,
    plan_memory,
    ram_cache_budget,
)
from tests.server_fixtures import start_server
from tests.test_startup import assert_one_clear_error, run_to_exit

# the bundled demo pair: 6 target layers x 2 KV heads x 64, a 2-layer draft (2 KV heads x 64), block 16, fp32;
# a KV block of 16 positions holds both: 16 x 8,192 bytes
DEMO_ROW = 2 * 6 * 2 * 64 * 4
DEMO_DRAFT_ROW = 2 * 2 * 2 * 64 * 4
DEMO_BLOCK_BYTES = 16 * (DEMO_ROW + DEMO_DRAFT_ROW)


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


def test_the_budget_buys_blocks_and_one_full_request_must_fit():
    costs = PoolCosts(target_row=1000, draft_row=100, state=0, kv_block=16, extra_len=17)
    assert costs.block_bytes == 16 * 1100 and costs.request_blocks(1000) == 64  # ceil(1017 / 16)
    assert costs.min_blocks(1000) == 65 and costs.max_len_within(65) == 64 * 16 - 17
    plan = plan_memory(costs, weights=10**9, slots=256, max_model_len=1000, model_max_len=40960,
                       cache_budget=1000 * costs.block_bytes + 7, source="--kv-cache-memory X")
    assert plan.num_blocks == 1000 and plan.pool_tokens == 999 * 16 and plan.slots == 256
    assert plan.target_kv == 1000 * 16 * 1000 and plan.draft_kv == 1000 * 16 * 100
    assert plan.caches <= plan.cache_budget
    assert plan.requests_of(1000) == 999 // 64 and plan.requests_of(10) == 256  # the running cap bounds it
    # unset max_model_len: the model's, lowered to what one request can hold
    assert plan_memory(costs, 0, 4, None, 512, 10**9, "x").max_model_len == 512
    small = plan_memory(costs, 0, 4, None, 40960, 65 * costs.block_bytes, "--kv-cache-memory Y")
    assert small.max_model_len == 64 * 16 - 17 and small.num_blocks == 65
    assert "max_model_len 1,007 (the model's 40,960 does not fit" in small.notes[0]
    # a set max_model_len that does not fit: one line saying what would
    with pytest.raises(ValueError) as err:
        plan_memory(costs, 0, 8, 32768, 40960, 65 * costs.block_bytes, "--kv-cache-memory 9MB")
    msg = str(err.value)
    assert "max_model_len 32,768 needs 2,050 KV blocks of 16 tokens (36.1 MB) for one request" in msg
    assert "--kv-cache-memory 9MB leaves 1.1 MB for caches: 64 blocks" in msg
    assert "which fits max_model_len <= 1,007: lower --max-model-len or raise --kv-cache-memory" in msg
    assert "\n" not in msg
    with pytest.raises(ValueError, match="which fits no request: raise --gpu-memory-utilization"):
        plan_memory(costs, 0, 8, 100, 4096, costs.block_bytes, "--gpu-memory-utilization 0.9 of 24.0 GB")
    with pytest.raises(ValueError, match="set --kv-cache-memory"):
        plan_memory(costs, 0, 8, 100, 4096, costs.block_bytes, "the cpu default")
    # no budget: every running request at full length (the runners' default pool)
    assert plan_memory(costs, 0, 8, 1000, 40960, None, "no budget set").num_blocks == 8 * 64 + 1


def test_a_hybrids_recurrent_states_come_first_and_cap_the_running_requests():
    costs = PoolCosts(target_row=1000, draft_row=100, state=10**6, kv_block=16, extra_len=17)
    plan = plan_memory(costs, 0, 256, 1000, 40960, 100 * 10**6, "--kv-cache-memory 100MB")
    assert plan.slots == 50 and plan.state == 50 * 10**6  # at most half of the budget
    assert plan.num_blocks == (100 * 10**6 - 50 * 10**6) // costs.block_bytes
    assert "running requests capped at 50 (max_num_seqs 256)" in plan.notes[0]
    roomy = plan_memory(costs, 0, 8, 1000, 40960, 100 * 10**6, "x")
    assert roomy.slots == 8 and roomy.state == 8 * 10**6 and not roomy.notes
    with pytest.raises(ValueError, match="one request's recurrent state takes 1.0 MB, more than half"):
        plan_memory(costs, 0, 8, 1000, 40960, 10**6, "--kv-cache-memory 1MB")


def test_a_hybrids_checkpoints_count_with_its_states():
    """With prefix caching each running request also holds checkpoint copies (in `state`) and the store takes
    max(4, running // 2) checkpoints: together with the states at most half of the budget."""
    costs = PoolCosts(target_row=1000, draft_row=100, state=6 * 10**6, kv_block=16, extra_len=17, checkpoint=10**6)
    assert costs.store_bytes(3) == 4 * 10**6 and costs.store_bytes(20) == 10 * 10**6
    plan = plan_memory(costs, 0, 256, 1000, 40960, 100 * 10**6, "--kv-cache-memory 100MB")
    # 7 x 6 MB + 4 x 1 MB = 46 MB <= 50 MB; 8 running would take 48 + 4 = 52 MB
    assert plan.slots == 7 and plan.state == 42 * 10**6 and plan.checkpoints == 4 * 10**6
    assert plan.num_blocks == (100 * 10**6 - 46 * 10**6) // costs.block_bytes and plan.caches <= plan.cache_budget
    assert "state checkpoints" in plan.notes[0] and "state checkpoints 4.0 MB" in plan.summary()
    no_budget = plan_memory(costs, 0, 10, 1000, 40960, None, "no budget set")
    assert no_budget.state == 60 * 10**6 and no_budget.checkpoints == 5 * 10**6
    with pytest.raises(ValueError, match=r"recurrent state takes 6.0 MB and the state checkpoints' 4.0 MB.*"
                                         r"raise --kv-cache-memory or --no-enable-prefix-caching"):
        plan_memory(costs, 0, 8, 1000, 40960, 19 * 10**6, "--kv-cache-memory 19MB")


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_a_hybrids_plan_from_its_config(prefix: bool):
    """load_models' plan of a tiny hybrid, from its config's shapes: live and rollback states and a step's rollback
    records per running request, with prefix caching 4 checkpoint copies more each and the store's
    max(4, running // 2); without, nothing more."""
    from tests.helpers import make_target

    model = make_target(None, "qwen3_5", seed=1)
    c = model.config
    linear = c.layer_types.count("linear_attention")
    conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    one = linear * (conv * (c.linear_conv_kernel_dim - 1) * 4
                    + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4)
    config = EngineConfig(device="cpu", max_running_requests=10, max_model_len=64, kv_cache_memory="4MiB",
                          enable_prefix_caching=prefix)
    # and the rollback records of a 1-token step (no draft: block 1): per linear layer the convolution input and
    # each value head's key, value, decay and beta (float32)
    hv = c.linear_num_value_heads
    records = linear * (conv * 4 + hv * (c.linear_key_head_dim + c.linear_value_head_dim + 2) * 4)
    plan = memory_budget(config, model, None, torch.device("cpu"), torch.float32, 1)
    assert plan.slots == 10
    assert plan.state == 10 * ((2 + (4 if prefix else 0)) * one + records)
    assert plan.checkpoints == (max(4, 10 // 2) * one if prefix else 0)
    row = kv_bytes_per_row({"num_hidden_layers": c.layer_types.count("full_attention"),
                            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim}, 4)
    assert plan.num_blocks == (4 * 2**20 - plan.state - plan.checkpoints) // (16 * row)


def test_the_default_budget_off_cuda_and_the_static_buckets():
    assert RAM_KV_DEFAULT_CAP == GIB
    assert ram_cache_budget(64 * GIB) == GIB and ram_cache_budget(None) == GIB
    assert ram_cache_budget(2 * GIB) == GIB // 2 and ram_cache_budget(2 * GIB, pending=GIB) == GIB // 4
    assert ram_cache_budget(100, pending=200) == 0
    # 256 running requests do not mean 256-row compiled graphs: the largest default bucket is MAX_STATIC_BATCH
    shapes = static_shapes(EngineConfig(compile=True), torch.device("cpu"), 256)
    assert shapes is not None and max(shapes.batch_sizes) == MAX_STATIC_BATCH == 64
    assert shapes.batch_sizes == (2, 4, 8, 16, 32, 64)
    assert static_shapes(EngineConfig(compile=True), torch.device("cpu"), 6).batch_sizes == (2, 4, 6)
    explicit = static_shapes(EngineConfig(compile=True, compile_batch_sizes="1,128"), torch.device("cpu"), 256)
    assert explicit is not None and explicit.batch_sizes == (2, 128)  # a bucket of 1 is 2


def test_bench_estimate_uses_the_same_arithmetic():
    est = memory_estimate("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", max_model_len=4096, max_running_requests=2)
    row = kv_bytes_per_row({"num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128}, 2)
    assert row == 147456 == est["target_kv_bytes_per_token"] and est["draft_kv_bytes_per_token"] == 20480
    assert est["num_blocks"] == 2 * -(-(4096 + 17) // 16) + 1  # no budget: both requests at full length
    assert est["target_kv_bytes"] == row * est["num_blocks"] * 16


def _demo_plan(device: str = "cpu", **kwargs: object):
    """The demo pair's plan, as load_models makes it (no runner is built; `device` only steers the budget)."""
    from dflash_core.draft_formats import read_draft_config
    from dflash_core.loading import DEMO_DRAFT, DEMO_TARGET, load_target

    config = EngineConfig(device="cpu", **kwargs)  # type: ignore[arg-type]
    model = load_target(DEMO_TARGET, torch.device("cpu"), torch.float32)
    cfg = read_draft_config(DEMO_DRAFT)
    return memory_budget(config, model, cfg, torch.device(device), torch.float32, cfg.block_size)


def test_cuda_budget_is_the_utilization_less_weights_reserve_and_logits(monkeypatch: pytest.MonkeyPatch):
    """On CUDA (faked: only the card's free and total memory are read): 0.9 of the card by default, less the
    weights, the activation reserve and the widest step's logits; never more than is free now."""
    from dflash_core.memory import ACTIVATION_RESERVE

    total, free = 80 * GIB, 79 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    plan = _demo_plan("cuda", max_running_requests=8)
    logits = 8 * 16 * 4096 * 4  # 8 requests verifying a block of 16, float32 over the demo's 4,096-token vocabulary
    budget = int(0.9 * total) - plan.weights - ACTIVATION_RESERVE - logits
    assert plan.cache_budget == budget and plan.source == "--gpu-memory-utilization 0.9 of 85.9 GB"
    assert plan.num_blocks == budget // DEMO_BLOCK_BYTES and plan.max_model_len == 2048
    wide = _demo_plan("cuda")  # 256 running: the logits of the step's 2,048-token budget
    assert wide.cache_budget == int(0.9 * total) - wide.weights - ACTIVATION_RESERVE - 2048 * 4096 * 4
    assert _demo_plan("cuda", gpu_memory_utilization=0.5).source.startswith("--gpu-memory-utilization 0.5 of")
    free = 10 * GIB  # another process holds most of the card
    capped = _demo_plan("cuda", max_running_requests=8)
    assert capped.cache_budget < 10 * GIB and "capped by the 10.7 GB free" in capped.source
    free = GIB
    with pytest.raises(ValueError, match="leaves nothing for the KV pool"):
        _demo_plan("cuda")


def test_demo_plan_in_pool_terms():
    plan = _demo_plan(kv_cache_memory=str(63 * DEMO_BLOCK_BYTES + 5))
    assert plan.num_blocks == 63 and plan.kv_block == 16 and plan.slots == 256
    assert plan.max_model_len == 62 * 16 - 17  # unset: the demo's 2,048 lowered so that one request fits
    assert plan.target_kv == 63 * 16 * DEMO_ROW and plan.draft_kv == 63 * 16 * DEMO_DRAFT_ROW
    line = plan.summary()
    assert "KV pool 62 blocks x 16 = 992 tokens" in line and "cache budget (--kv-cache-memory" in line
    assert "max_model_len 975: 1 request(s) of full length at once" in line
    default = _demo_plan()
    assert default.cache_budget is not None and default.cache_budget <= GIB
    assert default.source.startswith("the cpu default") and default.max_model_len == 2048
    assert _demo_plan(kv_block_size=32, kv_cache_memory="64MiB").num_blocks == (64 << 20) // (2 * DEMO_BLOCK_BYTES)
    hf = _demo_plan(backend="hf", kv_cache_memory="1MB")  # no pool: the budget does not apply
    assert hf.num_blocks is None and hf.max_model_len == 2048 and "no KV pool" in hf.summary()
    with pytest.raises(ValueError, match=r"max_model_len 2,048 needs 130 KV blocks .* fits max_model_len <= 79"):
        _demo_plan(max_model_len=2048, kv_cache_memory="1MB")
    with pytest.raises(ValueError, match="on cpu use --kv-cache-memory"):
        _demo_plan(gpu_memory_utilization=0.5)


def test_load_models_allocates_the_plan_and_logs_it(caplog):
    with caplog.at_level(logging.INFO, logger="dflash.loading"):
        models = load_models(EngineConfig(max_running_requests=2, kv_cache_memory=str(63 * DEMO_BLOCK_BYTES)))
    plan = models.memory
    assert plan is not None and plan.num_blocks == 63 and plan.max_model_len == 975
    engine = models.engine
    assert engine.max_model_len == 975
    target, drafter = engine.target, engine.drafter
    assert (target.num_blocks, target.kv_block_size) == (63, 16)
    assert plan.target_kv == target.kv_bytes_per_block * 63  # the plan is the allocation
    assert plan.draft_kv == drafter.draft_bytes_per_block * 63
    stats = engine.kv_stats()
    assert stats is not None and (stats.num_blocks, stats.block_size, stats.usage) == (63, 16, 0.0)
    messages = [r.getMessage() for r in caplog.records]
    line = next(m for m in messages if m.startswith("memory: "))
    assert "KV pool 62 blocks x 16 = 992 tokens" in line and "cache budget (--kv-cache-memory" in line
    assert any("max_model_len 975 (the model's 2,048" in m for m in messages)


def test_load_models_refuses_a_length_that_cannot_fit():
    with pytest.raises(ValueError, match=r"max_model_len 2,048 needs 130 KV blocks .*fits max_model_len <= \d"):
        load_models(EngineConfig(max_running_requests=4, max_model_len=2048, kv_cache_memory="1MB"))
    with pytest.raises(ValueError, match="on cpu use --kv-cache-memory"):
        load_models(EngineConfig(device="cpu", gpu_memory_utilization=0.5))


def test_a_length_past_the_models_positions_is_refused(monkeypatch: pytest.MonkeyPatch):
    """vLLM's rule: --max-model-len past the model's positions (the demo target's 2,048) is refused in one line,
    unless DFLASH_ALLOW_LONG_MAX_MODEL_LEN=1; a stretching rotary scaling (YaRN x4) counts."""
    with pytest.raises(ValueError, match=r"--max-model-len 4,096 is longer than the model's 2,048 positions .*"
                                         r"DFLASH_ALLOW_LONG_MAX_MODEL_LEN=1"):
        load_models(EngineConfig(device="cpu", max_model_len=4096, kv_cache_memory="64MiB"))
    monkeypatch.setenv("DFLASH_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert load_models(EngineConfig(device="cpu", max_model_len=4096, kv_cache_memory="64MiB")).engine.max_model_len \
        == 4096
    from transformers import Qwen3Config

    class Model:
        config = Qwen3Config(max_position_embeddings=40960,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 32768})

    assert (max_positions(Model()), longest_allowed(Model())) == (40960, 131072)  # Qwen3's YaRN, as vLLM reads it
    Model.config = Qwen3Config(max_position_embeddings=32768)
    assert (max_positions(Model()), longest_allowed(Model())) == (32768, 32768)


def test_serve_logs_the_budget_and_refuses_in_one_line(tmp_path: Path):
    code, lines = run_to_exit(["--device", "cpu", "--max-model-len", "2048", "--kv-cache-memory", "1MB"],
                              tmp_path / "refused.log")
    assert_one_clear_error(code, lines, "loading the models failed", "--kv-cache-memory 1MB", "fits max_model_len <=")
    server = start_server(["--device", "cpu", "--kv-cache-memory", "64MiB"], tmp_path / "ok.log")
    try:
        server.wait_ready()
        assert "memory: weights" in server.log_tail() and "--kv-cache-memory 64MiB" in server.log_tail()
        assert "KV pool 511 blocks x 16" in server.log_tail()
    finally:
        server.terminate()
