"""Settings: float values, the new settings and their defaults, validation, and ``--help`` showing defaults."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from server.settings import Settings, build_parser, convert, resolve_settings


def test_new_settings_and_defaults() -> None:
    s = Settings()
    assert s.allow_special_tokens is False
    assert s.sse_ping_interval == 15.0
    assert s.shutdown_timeout == 30.0
    assert (s.limit_concurrency, s.keep_alive_timeout, s.header_timeout) == (1024, 5.0, 10.0)


def test_float_settings_from_flag_environment_and_yaml(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("sse_ping_interval: 2\nshutdown_timeout: 0.25\nheader_timeout: 3.5\n")
    env = {"DFLASH_SHUTDOWN_TIMEOUT": "7.5", "DFLASH_ALLOW_SPECIAL_TOKENS": "true"}
    s = resolve_settings(["--config", str(config), "--header-timeout", "1e1", "--keep-alive-timeout", "3"], env=env)
    assert (s.sse_ping_interval, s.shutdown_timeout, s.header_timeout, s.keep_alive_timeout) == (2.0, 7.5, 10.0, 3.0)
    assert all(isinstance(v, float) for v in (s.sse_ping_interval, s.shutdown_timeout, s.keep_alive_timeout))
    assert s.allow_special_tokens is True
    assert resolve_settings(["--limit-concurrency", "7"], env={}).limit_concurrency == 7


@pytest.mark.parametrize("raw", ["abc", "nan", "inf", "", True])
def test_float_rejects_what_is_not_a_finite_number(raw: object) -> None:
    with pytest.raises(ValueError, match="sse_ping_interval"):
        convert("sse_ping_interval", raw, "test")


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--shutdown-timeout", "-1"),
        ("--sse-ping-interval", "0"),
        ("--header-timeout", "0"),
        ("--keep-alive-timeout", "-2"),
        ("--limit-concurrency", "0"),
        ("--tree-budget", "-1"),
        ("--tree-budget", "257"),
    ],
)
def test_impossible_values_are_refused(flag: str, value: str) -> None:
    with pytest.raises(ValueError, match=flag.lstrip("-").replace("-", "_")):
        resolve_settings([flag, value], env={})


def test_shutdown_timeout_zero_is_allowed() -> None:
    assert resolve_settings(["--shutdown-timeout", "0"], env={}).shutdown_timeout == 0.0


def test_help_shows_every_default() -> None:
    help_text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    options = help_text[help_text.index("options:") :]
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        match = re.search(re.escape(flag) + "[ ,]", options)
        assert match is not None, flag
        entry = options[match.start() : options.index("(env: DFLASH_", match.start())]
        assert "default" in entry, f"{flag} shows no default: {entry}"
        if f.default is not None:
            shown = ("on" if f.default else "off") if isinstance(f.default, bool) else str(f.default)
            assert f"(default: {shown})" in entry, entry


def test_kv_pool_settings_vllm_spellings_and_defaults(tmp_path: Path) -> None:
    """The paged KV cache's settings: vLLM's flags and defaults, environment and YAML, and what is refused."""
    s = Settings()
    assert (s.max_running_requests, s.kv_block_size, s.enable_prefix_caching) == (256, 16, True)
    assert s.max_model_len is None and s.kv_cache_memory is None and s.gpu_memory_utilization is None
    s = resolve_settings(["--max-num-seqs", "32", "--kv-block-size", "32", "--no-enable-prefix-caching",
                          "--max-model-len", "4096", "--block-size", "8"], env={})
    assert (s.max_running_requests, s.kv_block_size, s.enable_prefix_caching) == (32, 32, False)
    assert (s.max_model_len, s.block_size) == (4096, 8)  # --block-size stays the DFlash draft block
    flag_wins = resolve_settings(["--enable-prefix-caching"], env={"DFLASH_ENABLE_PREFIX_CACHING": "0"})
    assert flag_wins.enable_prefix_caching
    env = {"DFLASH_KV_BLOCK_SIZE": "64", "DFLASH_ENABLE_PREFIX_CACHING": "off", "DFLASH_MAX_RUNNING_REQUESTS": "9"}
    s = resolve_settings([], env=env)
    assert (s.kv_block_size, s.enable_prefix_caching, s.max_running_requests) == (64, False, 9)
    config = tmp_path / "kv.yaml"
    config.write_text("kv_block_size: 8\nenable_prefix_caching: false\nkv_cache_memory: 2GiB\n")
    s = resolve_settings(["--config", str(config)], env={})
    assert (s.kv_block_size, s.enable_prefix_caching, s.kv_cache_memory) == (8, False, "2GiB")
    for bad in ("0", "24", "512"):  # a power of two <= 256: the compiled steps' key buckets split into whole blocks
        with pytest.raises(ValueError, match="kv_block_size must be a power of two"):
            resolve_settings(["--kv-block-size", bad], env={})
    with pytest.raises(ValueError, match="max_num_batched_tokens must exceed max_running_requests"):
        resolve_settings(["--max-num-seqs", "4096"], env={})


def test_kv_pool_help_text() -> None:
    help_text = " ".join(build_parser().format_help().split())
    assert "--max-running-requests MAX_RUNNING_REQUESTS, --max-num-seqs MAX_RUNNING_REQUESTS" in help_text
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in help_text
    for phrase in ("the KV cache's block is --kv-block-size", "(default: 0.9 unless --kv-cache-memory is set",
                   "a quarter of the available RAM, at most 1 GiB", "the KV pool decides how many of them fit"):
        assert phrase in help_text, phrase


def test_presets_parse_with_the_pool_settings() -> None:
    presets = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
    assert len(presets) >= 8
    for preset in presets:
        s = resolve_settings(["--config", str(preset)], env={})
        assert s.kv_block_size == 16 and s.enable_prefix_caching, preset.name
        if s.device == "cuda" and s.backend == "auto":
            assert s.max_running_requests == 256 and s.gpu_memory_utilization == 0.9, preset.name


def test_a_text_setting_takes_none_as_its_value() -> None:
    """`--generation-config none` (a documented value) is the text "none", from a flag, the environment or YAML;
    an optional setting's "none" is still unset."""
    assert resolve_settings(["--generation-config", "none"], env={}).generation_config == "none"
    assert resolve_settings([], env={"DFLASH_GENERATION_CONFIG": "none"}).generation_config == "none"
    assert resolve_settings(["--served-model-name", "none"], env={}).served_model_name is None
    with pytest.raises(ValueError, match="must not be empty"):
        resolve_settings(["--generation-config", ""], env={})


def test_a_value_that_fails_validation_names_where_it_came_from(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="^environment DFLASH_TREE_BUDGET: tree_budget must be"):
        resolve_settings([], env={"DFLASH_TREE_BUDGET": "-3"})
    config = tmp_path / "c.yaml"
    config.write_text("spec_sampling: foo\n")
    with pytest.raises(ValueError, match=f"^{config}: spec_sampling must be one of"):
        resolve_settings(["--config", str(config)], env={})
    with pytest.raises(ValueError, match="^flag --tree-budget: tree_budget must be"):
        resolve_settings(["--tree-budget", "300"], env={"DFLASH_TREE_BUDGET": "3"})
