"""``--log-json``: every line the server writes is one JSON object (no progress bars, no ANSI, warnings too)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import httpx

from server.logs import JsonFormatter
from tests.server_fixtures import REPO, SERVED_NAME, make_scripted_pair, start_server


def json_lines(text: str) -> list[dict]:
    """Every line of ``text`` as a JSON object; fails naming the first line that is not one."""
    records = []
    for line in text.splitlines():  # also splits at "\r" (progress bars redraw with it)
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(record, dict), line
        assert "color_message" not in record and "\x1b" not in line and "\\u001b" not in line, line
        records.append(record)
    return records


def test_json_formatter_drops_color_message_and_ansi() -> None:
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started [\x1b[36m%d\x1b[0m]", (7,), None)
    record.color_message = "Started [\x1b[36m%d\x1b[0m]"
    record.request_id = "\x1b[1mr1\x1b[0m"
    out = json.loads(JsonFormatter().format(record))
    assert out["message"] == "Started [7]" and out["request_id"] == "r1" and "color_message" not in out


SCRIPT = """
import logging, sys, warnings
from server.logs import setup_logging
setup_logging("info", json_format=True)
from transformers.utils import logging as hf_logging
from huggingface_hub.utils import tqdm as hub_tqdm
hf_logging.get_logger("transformers.modeling_utils").warning("a transformers warning")
warnings.warn("a python warning")
logging.getLogger("uvicorn.error").info("Started [%d]", 1, extra={"color_message": "Started [\\x1b[36m%d\\x1b[0m]"})
for _ in hf_logging.tqdm(range(3), desc="Loading weights"):
    pass
for _ in hub_tqdm(range(3), desc="Fetching files"):
    pass
"""


def test_setup_logging_json_routes_transformers_warnings_and_silences_progress_bars() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    records = json_lines(out.stdout + out.stderr)
    by_message = {r["message"]: r for r in records}
    assert by_message["a transformers warning"]["logger"] == "transformers.modeling_utils"
    assert any("a python warning" in m and by_message[m]["logger"] == "py.warnings" for m in by_message)
    assert by_message["Started [1]"]["logger"] == "uvicorn.error"


def test_server_log_json_is_one_json_object_per_line(tmp_path: Path) -> None:
    target, draft = make_scripted_pair(tmp_path)
    args = ["--target", str(target), "--draft", str(draft), "--device", "cpu", "--served-model-name", SERVED_NAME]
    server = start_server([*args, "--log-json"], tmp_path / "server.log")
    try:
        server.wait_ready()
        chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
            assert client.post("/v1/chat/completions", json={**chat, "stream": True}).status_code == 200
            assert client.post("/v1/chat/completions", json={**chat, "model": "nope"}).status_code == 404
            bad = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert bad.status_code == 400
            assert client.get("/metrics").status_code == 200
    finally:
        assert server.terminate() == 0
    records = json_lines(server.log.read_text(errors="replace"))
    messages = [r["message"] for r in records]
    assert any(m.startswith("Uvicorn running on") for m in messages)
    assert any(m.startswith("serving ") for m in messages)
    assert sum(r.get("event") == "request_finished" for r in records) == 2
    assert any("draining" in m for m in messages)
