"""End to end with the real ``openai`` SDK on the bundled demo pair: structured outputs, forced tool calls and the
sampling controls, each identical between a DFlash server (started vLLM-style: ``dflash-serve TARGET
--speculative-config '{...}'``) and a ``--no-speculative`` server; ``/tokenize`` / ``/detokenize`` round trips.

The demo target is a tiny toy: schemas are chosen so that outputs terminate (enums, small integers, short strings).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from dflash_core.loading import DEMO_DRAFT, DEMO_TARGET
from tests.server_fixtures import ServerProcess, start_server

MODEL = "dflash-demo"
SPEC_CONFIG = json.dumps({"method": "dflash", "model": str(DEMO_DRAFT), "num_speculative_tokens": 7})
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Oslo", "Paris", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"], "additionalProperties": False},
    },
}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=1, le=9)
    name: str = Field(max_length=8)


@dataclass
class Pair:
    spec: ServerProcess
    plain: ServerProcess

    def clients(self) -> list[openai.OpenAI]:
        return [openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", timeout=120, max_retries=0)
                for s in (self.spec, self.plain)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("structured")
    common = ["--device", "cpu", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    spec = start_server([str(DEMO_TARGET), "--speculative-config", SPEC_CONFIG, "--speculation", "fixed", *common],
                        tmp / "spec.log")  # fixed widths: a test asserts that the draft ran, whatever the load
    plain = start_server(["--model", str(DEMO_TARGET), "--no-speculative", *common], tmp / "plain.log")
    try:
        spec.wait_ready()
        plain.wait_ready()
        yield Pair(spec, plain)
    finally:
        with ThreadPoolExecutor(2) as pool:  # both drain at once
            list(pool.map(ServerProcess.terminate, (spec, plain)))


def both(pair: Pair, call: Any) -> list[Any]:
    """``call(client)`` on the DFlash and the plain server at once: [spec result, plain result]."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(call, pair.clients()))


def test_parse_returns_the_pydantic_object_identical_with_and_without_speculation(pair: Pair) -> None:
    messages = [{"role": "user", "content": "Describe a pet as JSON."}]
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 11}):

        def parse(c: openai.OpenAI, sampling: dict[str, Any] = sampling) -> Any:
            return c.chat.completions.parse(model=MODEL, messages=messages, response_format=Pet, max_tokens=80,
                                            **sampling)

        spec, plain = both(pair, parse)
        parsed = spec.choices[0].message.parsed
        assert isinstance(parsed, Pet) and spec.choices[0].finish_reason == "stop"
        assert spec.choices[0].message.content == plain.choices[0].message.content


def test_json_object_is_a_json_object(pair: Pair) -> None:
    spec, plain = both(pair, lambda c: c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me JSON."}], temperature=0, max_tokens=60,
        response_format={"type": "json_object"}))
    content = spec.choices[0].message.content
    assert isinstance(json.loads(content), dict) and content == plain.choices[0].message.content


def test_required_and_named_tool_choice_return_valid_calls(pair: Pair) -> None:
    messages = [{"role": "user", "content": "What is the weather?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):

        def call(c: openai.OpenAI, choice: Any = choice) -> Any:
            return c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK],
                                             tool_choice=choice, parallel_tool_calls=False, temperature=0,
                                             max_tokens=200)

        spec, plain = both(pair, call)
        out = spec.choices[0]
        assert out.finish_reason == "tool_calls", out
        (call,) = out.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        other = plain.choices[0].message.tool_calls[0]
        assert (call.function.name, call.function.arguments) == (other.function.name, other.function.arguments)
        if choice == "required":
            required = call

    stream = pair.clients()[0].chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=200, stream=True)
    streamed: dict[str, str] = {}
    finish = None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.id is not None:
                streamed.update(id=d.id, name=d.function.name, arguments="")
            streamed["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and streamed["id"].startswith("call_")
    assert (streamed["name"], streamed["arguments"]) == (required.function.name, required.function.arguments)

    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                               "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    client = pair.clients()[0]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, CLOCK], max_tokens=16,
                                           temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_sampling_controls_keep_speculative_output_identical(pair: Pair) -> None:
    messages = [{"role": "user", "content": "Convert 5 kilometers to meters."}]

    def ask(**extra: Any) -> list[Any]:
        body = {"max_tokens": 40, **extra}
        return both(pair, lambda c: c.chat.completions.create(model=MODEL, messages=messages, **body))

    first = ask(temperature=0, max_tokens=1)[0].choices[0].message.content
    tokens = httpx.post(f"{pair.spec.url}/tokenize", json={"prompt": first, "add_special_tokens": False}).json()
    assert tokens["count"] == 1
    banned = tokens["tokens"][0]
    eos = 2  # the demo tokenizer's <|im_end|>
    cases = [
        {"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.8},
        {"temperature": 0, "extra_body": {"repetition_penalty": 1.4}},
        {"temperature": 0, "logit_bias": {str(banned): -100}},
        {"temperature": 0.8, "seed": 3, "extra_body": {"min_p": 0.2}},
        {"temperature": 0.8, "seed": 4, "presence_penalty": -1.0, "logit_bias": {str(banned): 3}},
        {"temperature": 0, "logit_bias": {str(eos): 100}, "extra_body": {"min_tokens": 6}},
    ]
    drafts = 0
    for extra in cases:
        spec, plain = ask(**extra)
        assert spec.choices[0].message.content == plain.choices[0].message.content, extra
        assert spec.usage.completion_tokens == plain.usage.completion_tokens
        drafts += spec.model_extra["dflash"]["num_drafts"]
        if "logit_bias" in extra and extra["logit_bias"].get(str(banned)) == -100:
            assert not spec.choices[0].message.content.startswith(first)
        if "min_tokens" in extra.get("extra_body", {}):
            assert spec.usage.completion_tokens == 7  # six tokens, then the favoured EOS
            assert spec.choices[0].finish_reason == "stop"
    assert drafts > 0  # the DFlash server did speculate


def test_tokenize_detokenize_round_trip_utf8(pair: Pair) -> None:
    text = "Grüße, 世界! 😀 ok"
    r = httpx.post(f"{pair.spec.url}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 2048
    assert httpx.post(f"{pair.spec.url}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    chat = httpx.post(f"{pair.spec.url}/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    assert httpx.post(f"{pair.spec.url}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == (
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    assert httpx.get(f"{pair.spec.url}/v1/models/{MODEL}").json()["dflash"]["block_size"] == 8
