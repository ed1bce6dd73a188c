"""End to end: real ``python -m server`` processes on 127.0.0.1, the real ``openai`` client, raw HTTP/SSE.

Two servers share the scripted tiny pair (tests/server_fixtures.py): DFlash (with an API key) and
``--no-speculative`` (small queue, for the 429 and SIGTERM tests). Greedy chat answers are known exactly:
``SCRIPT_TEXT`` = "Hi 你😀é\\ufffd✨", every character split across byte-level tokens, one verify step that
commits two tokens at once, then EOS.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.settings import Settings, resolve_settings
from tests.engine_gate import BOUND_S, engine_requests, open_gate, set_gate, start_gated_server
from tests.server_fixtures import (
    SCRIPT,
    SCRIPT_TEXT,
    SERVED_NAME,
    ServerProcess,
    make_scripted_pair,
    start_server,
)

API_KEY = "test-key"
CHAT = [{"role": "user", "content": "Say hi."}]
NO_EOS = {"ignore_eos": True}  # vLLM-style extra parameter
PROMPTS = [
    "The quick brown fox",
    "Hello world!",
    "def add(a, b):",
    "日本語のテキスト",
    "12 + 30 =",
    "a",
    "b",
    "😀",
]


@dataclass
class Servers:
    spec: ServerProcess
    ar: ServerProcess
    tokenizer: Any
    gate: Path  # the spec server's engine gate (tests.engine_gate): absent, the engine runs freely
    traffic: Path  # the spec server's --record-traffic folder


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("server_e2e")
    target, draft = make_scripted_pair(tmp)
    spec_args = (f"--target {target} --draft {draft} --served-model-name {SERVED_NAME} --api-key {API_KEY} "
                 f"--record-traffic {tmp / 'traffic'}")
    gate = tmp / "spec.gate"
    # fixed widths: the tests count drafts, accepted tokens and chunks per step; the adaptive policy, measuring a
    # loaded machine, may stop drafting
    spec = start_gated_server([*spec_args.split(), "--device", "cpu", "--speculation", "fixed"], tmp / "spec.log",
                              gate)
    # The plain server takes its settings from all three sources: flag > DFLASH_* environment > YAML.
    config = tmp / "ar.yaml"
    config.write_text(
        f"target: {target}\ndevice: cpu\nspeculative: true\nserved_model_name: from-yaml\n"
        "max_waiting_requests: 2\nmax_running_requests: 7\n"
    )
    ar = start_server(
        ["--config", str(config), "--served-model-name", SERVED_NAME, "--no-speculative"],
        tmp / "ar.log",
        # PyTorch's forward (not the fused CPU step): `--one-core` is then on by default, as the test below checks
        env={"DFLASH_SERVED_MODEL_NAME": "from-env", "DFLASH_MAX_RUNNING_REQUESTS": "2", "DFLASH_CPU_STEP": "torch"},
    )
    try:
        spec.wait_ready()
        ar.wait_ready()
        yield Servers(spec, ar, AutoTokenizer.from_pretrained(str(target)), gate, tmp / "traffic")
    finally:
        spec.terminate()
        ar.terminate()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=60, max_retries=0)


def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=60, max_retries=0)


def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def chat_prompt_tokens(tok: Any, messages: list[dict[str, str]]) -> int:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def collect_chat_stream(stream: Any) -> tuple[str, str | None, Any, list[Any]]:
    """(text, finish_reason, usage chunk, chunks) of a streamed chat completion (n=1)."""
    text, finish, usage_chunk, chunks = [], None, None, list(stream)
    for i, chunk in enumerate(chunks):
        if not chunk.choices:
            usage_chunk = chunk
            continue
        (choice,) = chunk.choices
        assert (choice.delta.role == "assistant") == (i == 0), "only the first chunk carries the role"
        assert finish is None, "nothing after the chunk with finish_reason"
        text.append(choice.delta.content or "")
        finish = choice.finish_reason
    return "".join(text), finish, usage_chunk, chunks


def idle(server: ServerProcess) -> bool:
    return httpx.get(f"{server.url}/health", timeout=5).json()["running"] == 0


# --- basics -------------------------------------------------------------------------------------------------


def test_health_version_models_metrics(servers: Servers) -> None:
    assert servers.spec.saw_503 or servers.ar.saw_503, "/health never answered 503 while loading"
    r = httpx.get(f"{servers.spec.url}/health", timeout=5)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert httpx.get(f"{servers.spec.url}/version", timeout=5).json()["version"]
    models = client(servers.spec).models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    metrics = httpx.get(f"{servers.spec.url}/metrics", timeout=5)
    assert metrics.status_code == 200 and "dflash_num_requests_running" in metrics.text


def test_settings_precedence(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("port: 1111\nhost: 0.0.0.0\nblock_size: 4\nlog_json: true\n")
    env = {"DFLASH_PORT": "2222", "DFLASH_BLOCK_SIZE": "8", "DFLASH_API_KEY": "k"}
    s = resolve_settings(["--config", str(config), "--port", "3333", "--no-log-json"], env=env)
    assert (s.port, s.host, s.block_size, s.log_json, s.api_key) == (3333, "0.0.0.0", 8, False, "k")
    assert resolve_settings([], env={}) == Settings()  # the bundled demo pair on 127.0.0.1:8000
    assert (Settings().host, Settings().port) == ("127.0.0.1", 8000)
    assert resolve_settings(["--target", "/some/model"], env={}).draft is None  # no demo draft for it
    demo = resolve_settings(["--config", str(Path(__file__).parent.parent / "configs" / "demo.yaml")], env={})
    assert demo.target is None and demo.draft is None  # null: the bundled demo pair
    config.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="prot"):
        resolve_settings(["--config", str(config)], env={})
    with pytest.raises(ValueError, match="DFLASH_PORT"):
        resolve_settings([], env={"DFLASH_PORT": "eighty"})


def test_load_failure_exits_1(tmp_path: Path) -> None:
    server = start_server(["--target", str(tmp_path / "missing"), "--device", "cpu"], tmp_path / "log")
    try:
        assert server.proc.wait(timeout=120) == 1
    finally:
        server.terminate()
    assert "missing" in server.log_tail()


def test_chat_greedy_matches_no_speculative(servers: Servers) -> None:
    n_prompt = chat_prompt_tokens(servers.tokenizer, CHAT)
    results = {}
    for name, server in (("spec", servers.spec), ("ar", servers.ar)):
        r = client(server).chat.completions.create(
            model=SERVED_NAME, messages=CHAT, temperature=0, max_tokens=64
        )
        (choice,) = r.choices
        assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == SERVED_NAME
        assert choice.message.role == "assistant" and choice.finish_reason == "stop"
        assert r.usage.prompt_tokens == n_prompt
        assert r.usage.completion_tokens == len(SCRIPT) + 1  # one token per byte, plus the EOS token
        assert r.usage.total_tokens == n_prompt + len(SCRIPT) + 1
        results[name] = (choice.message.content, r.model_extra["dflash"])
    assert results["spec"][0] == results["ar"][0] == SCRIPT_TEXT
    spec, ar = results["spec"][1], results["ar"][1]
    assert spec["num_drafts"] > 0 and spec["num_accepted_tokens"] >= 1
    assert spec["mean_acceptance_length"] == pytest.approx(
        1 + spec["num_accepted_tokens"] / spec["num_drafts"], abs=1e-3
    )
    assert ar == {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "mean_acceptance_length": 1.0,
    }


def test_chat_stream_is_one_chunk_per_step_and_concatenates(servers: Servers) -> None:
    for server in (servers.spec, servers.ar):
        stream = client(server).chat.completions.create(
            model=SERVED_NAME,
            messages=CHAT,
            temperature=0,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage_chunk, chunks = collect_chat_stream(stream)
        assert text == SCRIPT_TEXT and finish == "stop"
        assert usage_chunk is chunks[-1] and usage_chunk.choices == []
        assert usage_chunk.usage.completion_tokens == len(SCRIPT) + 1
        summary = usage_chunk.model_extra["dflash"]
        steps = summary["num_drafts"] + 1 if server is servers.spec else len(SCRIPT) + 1
        assert len(chunks) - 1 <= steps  # at most one event per engine step
        if server is servers.spec:  # the accepted prefix went out as one chunk: fewer chunks than tokens
            assert len(chunks) - 1 < len(SCRIPT) + 1


def test_raw_sse_framing(servers: Servers) -> None:
    body = {
        "model": SERVED_NAME,
        "messages": CHAT,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{servers.spec.url}/v1/chat/completions", json=body, headers=headers(), timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    text = raw.decode("utf-8")  # strict: the stream is valid UTF-8
    events = text.split("\n\n")
    assert events[0] == ": ping"  # every stream starts with a comment (headers at once)
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = []
    for event in [e for e in events[1:-2] if e != ": ping"]:
        assert event.startswith("data: ") and "\n" not in event, event
        payloads.append(json.loads(event[len("data: ") :]))
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[-2]["choices"][0]["finish_reason"] == "stop"
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == len(SCRIPT) + 1
    assert len({p["id"] for p in payloads}) == 1


def test_utf8_split_characters_stream_as_valid_text(servers: Servers) -> None:
    stream = client(servers.spec).chat.completions.create(
        model=SERVED_NAME, messages=CHAT, temperature=0, stream=True
    )
    so_far = ""
    for chunk in stream:
        for choice in chunk.choices:
            so_far += choice.delta.content or ""
            # a character split across tokens or steps is never sent half: each prefix is a prefix of the text
            assert SCRIPT_TEXT.startswith(so_far), (so_far, SCRIPT_TEXT)
    assert so_far == SCRIPT_TEXT
    assert SCRIPT_TEXT.count("\ufffd") == 1  # only the byte that is invalid UTF-8 in the script itself


def test_completions_match_no_speculative_streamed_and_not(servers: Servers) -> None:
    tok = servers.tokenizer
    for prompt in PROMPTS[:3]:
        texts = []
        for server in (servers.spec, servers.ar):
            c = client(server)
            r = c.completions.create(
                model=SERVED_NAME, prompt=prompt, temperature=0, max_tokens=16, extra_body=NO_EOS
            )
            (choice,) = r.choices
            assert r.id.startswith("cmpl-") and r.object == "text_completion"
            assert choice.finish_reason == "length" and r.usage.completion_tokens == 16
            assert r.usage.prompt_tokens == len(tok(prompt)["input_ids"])
            streamed, finish, usage = [], None, None
            for chunk in c.completions.create(
                model=SERVED_NAME,
                prompt=prompt,
                temperature=0,
                max_tokens=16,
                extra_body=NO_EOS,
                stream=True,
                stream_options={"include_usage": True},
            ):
                for ch in chunk.choices:
                    streamed.append(ch.text)
                    finish = ch.finish_reason or finish
                usage = chunk.usage or usage
            assert "".join(streamed) == choice.text and finish == "length"
            assert usage.completion_tokens == 16
            texts.append(choice.text)
        assert texts[0] == texts[1], prompt


def test_async_client_chat_and_completions(servers: Servers) -> None:
    async def run() -> tuple[str, str, str]:
        c = aclient(servers.spec)
        r = await c.chat.completions.create(model=SERVED_NAME, messages=CHAT, temperature=0)
        parts = []
        async for chunk in await c.chat.completions.create(
            model=SERVED_NAME, messages=CHAT, temperature=0, stream=True
        ):
            parts.extend(ch.delta.content or "" for ch in chunk.choices)
        comp = await c.completions.create(
            model=SERVED_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=16, extra_body=NO_EOS
        )
        await c.close()
        return r.choices[0].message.content, "".join(parts), comp.choices[0].text

    chat, streamed, comp = asyncio.run(run())
    assert chat == streamed == SCRIPT_TEXT
    solo = client(servers.ar).completions.create(
        model=SERVED_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=16, extra_body=NO_EOS
    )
    assert comp == solo.choices[0].text


def test_eight_concurrent_streams_each_get_their_solo_output(servers: Servers) -> None:
    c = client(servers.spec)
    kwargs = {"model": SERVED_NAME, "temperature": 0, "max_tokens": 16, "extra_body": NO_EOS}
    solo = [c.completions.create(prompt=p, **kwargs).choices[0].text for p in PROMPTS]
    assert len(set(solo)) > 1

    async def one(ac: openai.AsyncOpenAI, prompt: str) -> str:
        parts = []
        async for chunk in await ac.completions.create(prompt=prompt, stream=True, **kwargs):
            parts.extend(ch.text for ch in chunk.choices)
        return "".join(parts)

    async def run() -> list[str]:
        ac = aclient(servers.spec)
        try:
            return list(await asyncio.gather(*(one(ac, p) for p in PROMPTS)))
        finally:
            await ac.close()

    assert asyncio.run(run()) == solo


# --- request features ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "text", "tokens"),
    [
        ("😀é", "Hi 你", 12),  # cut exactly; "é" completes the stop string at the 12th token
        (["✨", "é"], "Hi 你😀", 12),  # the earliest of several
        ("i 你😀é\ufffd✨", "H", 16),  # spans every step
        ("nowhere", SCRIPT_TEXT, 17),  # never matches: ends with EOS as usual
    ],
)
def test_stop_strings(servers: Servers, stop: Any, text: str, tokens: int) -> None:
    c = client(servers.spec)
    r = c.chat.completions.create(model=SERVED_NAME, messages=CHAT, temperature=0, stop=stop)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, "stop")
    assert r.usage.completion_tokens == tokens
    streamed, finish, usage_chunk, _ = collect_chat_stream(
        c.chat.completions.create(
            model=SERVED_NAME,
            messages=CHAT,
            temperature=0,
            stop=stop,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert (streamed, finish, usage_chunk.usage.completion_tokens) == (text, "stop", tokens)


def test_stop_token_ids(servers: Servers) -> None:
    stop_id = servers.tokenizer.convert_tokens_to_ids("Ã")  # byte 0xC3, the first byte of "é"
    r = client(servers.spec).chat.completions.create(
        model=SERVED_NAME, messages=CHAT, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hi 你😀", "stop")
    assert r.usage.completion_tokens == 11  # the stop token counts; its text is not sent


def test_max_tokens_and_max_completion_tokens(servers: Servers) -> None:
    c = client(servers.spec)
    r = c.chat.completions.create(model=SERVED_NAME, messages=CHAT, temperature=0, max_completion_tokens=6)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hi 你", "length")
    assert r.usage.completion_tokens == 6
    # cut inside a character: the end of the stream releases it as U+FFFD, as a full decode does
    r = c.chat.completions.create(model=SERVED_NAME, messages=CHAT, temperature=0, max_tokens=4)
    assert (r.choices[0].message.content, r.usage.completion_tokens) == ("Hi \ufffd", 4)
    r = c.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, temperature=0, max_tokens=4, max_completion_tokens=3
    )
    assert r.usage.completion_tokens == 3


def test_logprobs_chat_and_completions(servers: Servers) -> None:
    c = client(servers.spec)
    r = c.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == len(SCRIPT)  # one per token of the text (EOS excluded)
    assert b"".join(bytes(t.bytes) for t in content) == SCRIPT
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely one
    streamed = []
    for chunk in c.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, temperature=0, logprobs=True, top_logprobs=3, stream=True
    ):
        for ch in chunk.choices:
            streamed.extend(ch.logprobs.content if ch.logprobs else [])
    # the same tokens and alternatives; the values agree to float rounding (the adaptive width policy may verify
    # the two runs' tokens in rows of different widths, which changes the matmul shapes)
    assert [(t.token, [a.token for a in t.top_logprobs]) for t in streamed] == [
        (t.token, [a.token for a in t.top_logprobs]) for t in content]
    for a, b in zip(streamed, content):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [x.logprob for x in a.top_logprobs] == pytest.approx([x.logprob for x in b.top_logprobs], abs=1e-4)
    r = c.chat.completions.create(model=SERVED_NAME, messages=CHAT, temperature=0)
    assert r.choices[0].logprobs is None

    comp = c.completions.create(
        model=SERVED_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=8, extra_body=NO_EOS, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_n_choices_seed_and_sampling(servers: Servers) -> None:
    c = client(servers.spec)
    kwargs = {
        "model": SERVED_NAME,
        "prompt": PROMPTS[1],
        "max_tokens": 12,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 7,
        "extra_body": {**NO_EOS, "top_k": 50},
    }
    r = c.completions.create(n=3, **kwargs)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens == len(
        servers.tokenizer(PROMPTS[1])["input_ids"]
    )
    again = c.completions.create(n=3, **kwargs)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]  # seeded: reproducible
    first = c.completions.create(n=1, **kwargs)  # choice i uses seed + i
    assert first.choices[0].text == r.choices[0].text
    chat = c.chat.completions.create(
        model=SERVED_NAME,
        messages=CHAT,
        n=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {0: "", 1: ""}
    roles: dict[int, int] = {0: 0, 1: 0}
    usage = None
    for chunk in chat:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            roles[ch.index] += ch.delta.role == "assistant"
        usage = chunk.usage or usage
    assert texts == {0: SCRIPT_TEXT, 1: SCRIPT_TEXT} and roles == {0: 1, 1: 1}
    assert usage.completion_tokens == 2 * (len(SCRIPT) + 1)


def test_message_forms_and_template_kwargs(servers: Servers) -> None:
    c = client(servers.spec)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again."},
    ]
    r = c.chat.completions.create(
        model=SERVED_NAME,
        messages=messages,
        temperature=0,
        user="someone",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].message.content == SCRIPT_TEXT
    flat = [{**m, "content": "Say hi."} if isinstance(m["content"], list) else m for m in messages]
    assert r.usage.prompt_tokens == chat_prompt_tokens(servers.tokenizer, flat)


# --- errors -------------------------------------------------------------------------------------------------


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": CHAT, **extra}


BAD_REQUESTS = [
    # (name, path, body (dict or raw bytes), status, code, word the message or param must contain)
    ("malformed json", "chat/completions", b'{"model": "tiny", "messages": [', 400, None, "JSON"),
    ("not an object", "chat/completions", b"[1, 2]", 400, None, ""),
    ("empty body", "chat/completions", b"", 400, None, "empty"),
    (
        "messages not a list",
        "chat/completions",
        {"model": SERVED_NAME, "messages": "hi"},
        400,
        None,
        "messages",
    ),
    ("max_tokens a string", "chat/completions", _chat(max_tokens="10"), 400, None, "max_tokens"),
    ("temperature a string", "chat/completions", _chat(temperature="hot"), 400, None, "temperature"),
    ("missing model", "chat/completions", {"messages": CHAT}, 400, None, "model"),
    ("empty messages", "chat/completions", _chat(messages=[]), 400, None, "messages"),
    (
        "unknown role",
        "chat/completions",
        _chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        None,
        "role",
    ),
    (
        "image part",
        "chat/completions",
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        None,
        "image_url",
    ),
    ("temperature -1", "chat/completions", _chat(temperature=-1), 400, None, "temperature"),
    ("temperature 5", "chat/completions", _chat(temperature=5), 400, None, "temperature"),
    ("top_p 0", "chat/completions", _chat(top_p=0), 400, None, "top_p"),
    ("max_tokens 0", "chat/completions", _chat(max_tokens=0), 400, None, "max_tokens"),
    (
        "beyond the context",
        "chat/completions",
        _chat(max_tokens=100_000),
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    ("unknown model", "chat/completions", _chat(model="gpt-17"), 404, "model_not_found", "gpt-17"),
    ("n=100", "chat/completions", _chat(n=100), 400, None, "n"),
    ("top_logprobs 21", "chat/completions", _chat(logprobs=True, top_logprobs=21), 400, None, "top_logprobs"),
    ("tool without function", "chat/completions", _chat(tools=[{"type": "function"}]), 400, None, "tools"),
    (
        "auto tool choice without --enable-auto-tool-choice",
        "chat/completions",
        _chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        None,
        "tool_choice",
    ),
    (
        "tool_choice names no tool",
        "chat/completions",
        _chat(tools=[{"type": "function", "function": {"name": "f"}}],
              tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        None,
        "tool_choice",
    ),
    (
        "response_format xml",
        "chat/completions",
        _chat(response_format={"type": "xml"}),
        400,
        None,
        "response_format",
    ),
    ("presence_penalty 3", "chat/completions", _chat(presence_penalty=3), 400, None, "presence_penalty"),
    ("logit_bias word key", "chat/completions", _chat(logit_bias={"five": 10}), 400, None, "logit_bias"),
    ("min_p 2", "chat/completions", _chat(min_p=2), 400, None, "min_p"),
    ("best_of 2", "chat/completions", _chat(best_of=2), 400, None, "best_of"),
    ("unknown field", "chat/completions", _chat(frobnicate=True), 400, None, "frobnicate"),
    (
        "stream_options without stream",
        "chat/completions",
        _chat(stream_options={"include_usage": True}),
        400,
        None,
        "stream_options",
    ),
    ("empty stop", "chat/completions", _chat(stop=""), 400, None, "stop"),
    ("17 stop strings", "chat/completions", _chat(stop=[f"s{i}" for i in range(17)]), 400, None, "at most 16"),
    ("17 stop strings, completions", "completions",
     {"model": SERVED_NAME, "prompt": "x", "stop": list("abcdefghijklmnopq")}, 400, None, "at most 16 stop strings"),
    ("empty prompt", "completions", {"model": SERVED_NAME, "prompt": ""}, 400, None, "prompt"),
    (
        "prompt ids out of vocab",
        "completions",
        {"model": SERVED_NAME, "prompt": [10**9]},
        400,
        None,
        "prompt",
    ),
    ("echo", "completions", {"model": SERVED_NAME, "prompt": "x", "echo": True}, 400, None, "echo"),
    (
        "completion beyond the context",
        "completions",
        {"model": SERVED_NAME, "prompt": "x", "max_tokens": 5000},
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    (
        "10 MB body",
        "chat/completions",
        _chat(messages=[{"role": "user", "content": "x" * 10_000_000}]),
        413,
        None,
        "bytes",
    ),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "code", "word"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_requests_get_the_error_envelope(
    servers: Servers, name: str, path: str, body: Any, status: int, code: str | None, word: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{servers.spec.url}/v1/{path}",
        content=content,
        timeout=60,
        headers={**headers(), "Content-Type": "application/json"},
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code
    assert word.lower() in f"{err['message']} {err['param']}".lower(), err
    assert httpx.get(f"{servers.spec.url}/health", timeout=5).status_code == 200


def test_sdk_raises_typed_errors_and_server_keeps_serving(servers: Servers) -> None:
    c = client(servers.spec)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=SERVED_NAME, messages=CHAT, temperature=5)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=CHAT)
    r = httpx.get(f"{servers.spec.url}/v1/nothing", timeout=5)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert (
        c.chat.completions.create(model=SERVED_NAME, messages=CHAT, temperature=0).choices[0].message.content
        == SCRIPT_TEXT
    )


def test_api_key(servers: Servers) -> None:
    url = f"{servers.spec.url}/v1/chat/completions"
    prefixes = [{"Authorization": f"Bearer {API_KEY[:n]}".strip()} for n in (0, 1, len(API_KEY) - 1)]
    for hdrs in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, *prefixes):
        r = httpx.post(url, json=_chat(), headers=hdrs, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{servers.spec.url}/v1/models", timeout=5).status_code == 401
    assert httpx.get(f"{servers.spec.url}/health", timeout=5).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{servers.spec.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.post(url, json=_chat(), headers=headers(), timeout=30).status_code == 200


# --- lifecycle: disconnects, a full queue, SIGTERM ----------------------------------------------------------


def _long_completion(stream: bool = True) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "prompt": PROMPTS[0],
        "max_tokens": 900,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def test_disconnect_aborts_within_a_second(servers: Servers) -> None:
    server = servers.spec
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=_long_completion(), headers=headers(), timeout=60
    ) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 3:
                break
        assert not idle(server)
    t0 = time.monotonic()
    while not idle(server):
        assert time.monotonic() - t0 < 1.0, "request still running a second after the client left"
        time.sleep(0.02)
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'dflash_requests_total{finished_reason="abort"} 1.0' in metrics


def abort_count(server: ServerProcess) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    line = next((x for x in metrics.splitlines() if x.startswith('dflash_requests_total{finished_reason="abort"}')),
                None)
    return float(line.split()[-1]) if line else 0.0


def test_non_streaming_disconnect_aborts(servers: Servers) -> None:
    """A client that leaves a non-streamed request aborts it: the engine is held mid-request, so no timing."""
    server, gate = servers.spec, servers.gate
    before = abort_count(server)

    async def leave_mid_request() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=BOUND_S) as ac:
            task = asyncio.create_task(ac.post("/v1/completions", json=_long_completion(stream=False)))
            t0 = time.monotonic()
            while engine_requests(gate) < 1:  # admitted, then held after a few steps
                assert not task.done(), "the request ended while the engine was held"
                assert time.monotonic() - t0 < BOUND_S, "the request never reached the engine"
                await asyncio.sleep(0.02)
            task.cancel()  # the client goes away
            await asyncio.gather(task, return_exceptions=True)

    set_gate(gate, 3)
    try:
        asyncio.run(leave_mid_request())
        assert not idle(server)
    finally:
        open_gate(gate)
    t0 = time.monotonic()
    while not idle(server):
        assert time.monotonic() - t0 < BOUND_S, "non-streamed request still running after the client left"
        time.sleep(0.02)
    assert abort_count(server) == before + 1


def test_full_queue_answers_429(servers: Servers) -> None:
    server = servers.ar  # 2 running + 2 waiting

    async def hold(ac: httpx.AsyncClient) -> None:
        async with ac.stream("POST", "/v1/completions", json=_long_completion()) as r:
            async for _ in r.aiter_lines():
                pass

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            holders = [asyncio.create_task(hold(ac)) for _ in range(4)]
            try:
                t0 = time.monotonic()
                while (await ac.get("/health")).json() != {"status": "ok", "running": 2, "waiting": 2}:
                    assert time.monotonic() - t0 < 10, "the queue never filled"
                    await asyncio.sleep(0.02)
                r = await ac.post("/v1/completions", json=_long_completion(stream=False))
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
            finally:
                for task in holders:
                    task.cancel()  # disconnects: running and waiting requests are dropped
                await asyncio.gather(*holders, return_exceptions=True)

    asyncio.run(run())
    t0 = time.monotonic()
    while httpx.get(f"{server.url}/health", timeout=5).json() != {"status": "ok", "running": 0, "waiting": 0}:
        assert time.monotonic() - t0 < 2.0, "aborted requests still hold the queue"
        time.sleep(0.02)
    too_many = httpx.post(
        f"{server.url}/v1/completions", json={**_long_completion(stream=False), "n": 8}, timeout=30
    )
    assert too_many.status_code == 400  # more choices than the server can ever hold
    ok = client(server).completions.create(model=SERVED_NAME, prompt="x", max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3


def test_event_loop_and_worker_share_one_core_and_helpers_keep_every_core(servers: Servers) -> None:
    """`--one-core`, the default on a CPU device with one torch thread running PyTorch's forward: the event loop's
    thread (the main thread) is on the core the log names, with the worker thread beside it; a helper process
    started afterwards (a body with many values is parsed in one) and the tokenization pool's threads run on every
    core the server had. With the fused CPU step (the DFlash server) nothing is pinned: the loop works on the other
    core while the step's C call runs."""
    from server import affinity

    if not affinity.supported():
        pytest.skip("thread affinity needs Linux and more than one core")
    fused = servers.spec
    if "fused CPU step off" not in fused.log.read_text():  # else PyTorch's forward (DFLASH_CPU_STEP=torch, no cc)
        assert "event loop and worker thread on core" not in fused.log.read_text(), fused.log_tail()
        assert all(cores == os.sched_getaffinity(0) for cores in _threads_cores(fused.proc.pid).values())
    server = servers.ar
    logged = [line for line in server.log.read_text().splitlines() if "event loop and worker thread on core" in line]
    assert len(logged) == 1, server.log_tail()
    core = int(logged[0].split("on core ")[1].split()[0])
    many_values = {"model": SERVED_NAME, "messages": CHAT, "max_tokens": 1, "stop": ["x"] * 3000}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=many_values, timeout=60)  # tokenized in the pool
    assert r.status_code in (200, 400), r.text
    cores = _threads_cores(server.proc.pid)
    assert cores[server.proc.pid] == {core}, cores  # the main thread runs the event loop
    assert sum(c == {core} for c in cores.values()) == 2, cores  # and the worker thread; pool threads do not
    helpers = _children(server.proc.pid)
    assert helpers, "a body with 3000 values is parsed in a helper process"
    assert all(os.sched_getaffinity(h) == os.sched_getaffinity(0) != {core} for h in helpers)


def test_sigterm_drains_in_flight_requests_and_exits_0(servers: Servers) -> None:
    server = servers.ar  # the last test to use it
    body = {
        "model": SERVED_NAME,
        "prompt": PROMPTS[2],
        "max_tokens": 30,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 1:
                    server.proc.terminate()  # SIGTERM mid-stream
    assert events[-1] == "data: [DONE]"
    finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish[-1] == "length"  # drained: the request ran to its end
    assert server.proc.wait(timeout=30) == 0


def _threads_cores(pid: int) -> dict[int, set[int]]:
    """Each thread's cores (threads that end meanwhile, such as idle pool threads, are left out)."""
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(t.name)] = os.sched_getaffinity(int(t.name))
        except (ProcessLookupError, FileNotFoundError):
            continue
    return out


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_the_server_records_what_it_answered(servers: Servers) -> None:
    """--record-traffic: the answered request's prompt and output token ids and acceptance, as one JSON line; a
    request with "store": false is never written (records are written in order, so once the later one is there the
    earlier one would be too)."""
    from server.traffic import shard_paths

    c = client(servers.spec)
    c.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "keep this private"}],
                              max_tokens=8, temperature=0, store=False)
    kept = c.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}],
                                     max_tokens=32, temperature=0)

    def rows() -> dict[str, dict[str, Any]]:
        lines = [line for p in shard_paths(servers.traffic) for line in p.read_text().splitlines()]
        return {r["id"]: r for r in map(json.loads, lines)}

    deadline = time.monotonic() + 30
    while f"{kept.id}-0" not in rows() and time.monotonic() < deadline:
        time.sleep(0.05)
    row = rows()[f"{kept.id}-0"]
    tok = servers.tokenizer
    assert row["model"] == SERVED_NAME and row["finish_reason"] == "stop"
    assert kept.choices[0].message.content == SCRIPT_TEXT
    assert tok.decode(row["output_token_ids"], skip_special_tokens=True) == SCRIPT_TEXT
    assert tok.decode(row["prompt_token_ids"]).endswith("assistant\n")
    assert row["num_drafts"] == kept.model_extra["dflash"]["num_drafts"] > 0
    private = [r for r in rows().values() if "private" in tok.decode(r["prompt_token_ids"])]
    assert not private
