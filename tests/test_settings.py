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
