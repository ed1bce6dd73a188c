"""The README's first command: `dflash-serve` with no arguments serves the bundled demo pair (no download).

The curl and openai-SDK examples of the README and docs/api.md run as written against it (only the port differs).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from openai import OpenAI

from tests.server_fixtures import start_server


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    # the default command; the width policy pinned (the adaptive one may stop drafting on a loaded machine, and the
    # test asserts that the draft ran)
    server = start_server([], tmp_path_factory.mktemp("demo") / "server.log", env={"DFLASH_SPECULATION": "fixed"})
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.terminate() == 0


def test_default_command_serves_the_demo_pair(demo_server):
    client = OpenAI(base_url=f"{demo_server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["dflash-demo"]
    messages = [{"role": "user", "content": "Convert 5 kilometers to meters."}]
    r = client.chat.completions.create(model="dflash-demo", messages=messages, max_tokens=64, temperature=0)
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens > 0
    summary = r.model_extra["dflash"]
    assert summary["num_drafts"] > 0 and summary["mean_acceptance_length"] > 1.0  # the trained draft is accepted

    stream = client.chat.completions.create(model="dflash-demo", messages=messages, max_tokens=64, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, last = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        else:
            last = chunk
    assert "".join(parts) == text
    # the same tokens and, with fixed widths, the same speculation counters
    assert last.usage.completion_tokens == r.usage.completion_tokens
    streamed_summary = last.model_extra["dflash"]
    assert streamed_summary == summary


def test_readme_curl_example(demo_server):
    body = {"model": "dflash-demo", "messages": [{"role": "user", "content": "Convert 5 kilometers to meters."}],
            "max_tokens": 64, "temperature": 0}
    out = subprocess.run(
        ["curl", "-s", f"{demo_server.url}/v1/chat/completions", "-H", "Content-Type: application/json",
         "-d", json.dumps(body)],
        capture_output=True, check=True, timeout=60,
    )
    reply = json.loads(out.stdout)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
