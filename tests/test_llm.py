"""The Python API (`from dflash_core import LLM, SamplingParams`) on the bundled demo pair: generate and stream,
chat and raw prompts, token ids, stop strings, and output identical to plain decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_core import LLM, SamplingParams

CHATS = [
    [{"role": "user", "content": "Convert 5 kilometers to meters."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "What is 48 plus 27?"}],
]
PARAMS = SamplingParams(max_tokens=48)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # fixed widths: the tests assert that the draft ran (the adaptive policy may stop drafting on a loaded machine)
    return LLM(device="cpu", dtype="float32", max_running_requests=4, speculation="fixed")


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(device="cpu", dtype="float32", speculative=False)


def test_readme_example_runs_as_written() -> None:
    """The README's Python API example, verbatim from the README."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"<!-- python-api-example -->\n```python\n(.*?)```", readme, re.S)
    assert block, "README lost its Python API example"
    scope: dict = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)  # noqa: S102 - our own README
    assert "5000 meters" in scope["out"].text


def test_generate_chat_is_identical_to_plain_decoding(llm: LLM, plain: LLM) -> None:
    spec = llm.generate(CHATS, PARAMS)
    ref = plain.generate(CHATS, PARAMS)
    assert [g.token_ids for g in spec] == [g.token_ids for g in ref]
    assert [g.text for g in spec] == [g.text for g in ref]
    for g in spec:
        assert g.finish_reason in ("stop", "length") and g.text
        assert g.spec.num_drafts > 0 and g.spec.mean_acceptance_length > 1.0
        assert g.prompt_token_ids == llm.encode(CHATS[spec.index(g)])
    assert all(g.spec.num_drafts == 0 for g in ref)
    assert llm.engine.num_running() == 0 and llm.engine.kv.slots.num_free() == 4


def test_prompt_forms_agree(llm: LLM) -> None:
    """A conversation, its rendered text, its ids and apply_chat_template(tokenize=True)'s BatchEncoding give the
    same output; one prompt may be given without a list."""
    tok = llm.tokenizer
    chat = CHATS[0]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    encoding = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    ids = llm.encode(chat)
    forms = (chat, encoding, ids, [ids], torch.tensor(ids), np.array(ids), [np.int64(t) for t in ids])
    outs = [llm.generate(p, PARAMS)[0] for p in forms]
    assert len({tuple(o.token_ids) for o in outs}) == 1
    raw = llm.generate(text, PARAMS)[0]  # raw text: the tokenizer's own BOS rules (this one adds none)
    assert raw.token_ids == outs[0].token_ids
    streamed = list(llm.stream(text, PARAMS))  # a raw prompt streams the same tokens and text
    assert [t for c in streamed for t in c.token_ids] == raw.token_ids
    assert "".join(c.text for c in streamed) == raw.text and streamed[-1].finish_reason == raw.finish_reason


def test_stream_yields_the_generated_text_step_by_step() -> None:
    # the fixed width policy: the speculation counters then repeat exactly (the adaptive one follows timings)
    llm = LLM(device="cpu", dtype="float32", max_running_requests=4, speculation="fixed")
    whole = llm.generate(CHATS, PARAMS)
    chunks = list(llm.stream(CHATS, PARAMS))
    for i, g in enumerate(whole):
        mine = [c for c in chunks if c.index == i]
        assert "".join(c.text for c in mine) == g.text
        assert [t for c in mine for t in c.token_ids] == g.token_ids
        assert mine[-1].finish_reason == g.finish_reason and mine[-1].spec == g.spec
        assert all(c.finish_reason is None for c in mine[:-1])
        assert any(len(c.token_ids) > 1 for c in mine)  # speculative steps commit several tokens at once


def test_stop_string_and_early_exit_free_the_slots(llm: LLM) -> None:
    full = llm.generate(CHATS[0], PARAMS)[0]
    cut = llm.generate(CHATS[0], SamplingParams(max_tokens=48, stop=["="]))[0]
    assert "=" in full.text and cut.text == full.text[: full.text.index("=")]
    assert cut.finish_reason == "stop"
    one = llm.generate(CHATS[0], SamplingParams(max_tokens=48, stop="="))[0]  # one string, as vLLM takes it
    assert (one.text, one.finish_reason) == (cut.text, "stop")
    stream = llm.stream(CHATS, SamplingParams(max_tokens=200))
    next(stream)
    stream.close()  # the caller stops early: what still runs is aborted
    assert llm.engine.num_running() == 0 and llm.engine.kv.slots.num_free() == 4


def test_an_open_stream_blocks_other_calls(llm: LLM) -> None:
    """A second call would step (and swallow) the open stream's requests: it is refused until the stream ends."""
    stream = llm.stream(CHATS[0], PARAMS)
    first = next(stream)
    with pytest.raises(RuntimeError, match="open stream"):
        llm.generate(CHATS[1], PARAMS)
    rest = list(stream)
    assert first.text + "".join(c.text for c in rest) == llm.generate(CHATS[0], PARAMS)[0].text


def test_one_sampling_params_per_prompt(llm: LLM) -> None:
    each = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 9, 13)]
    outs = llm.generate(CHATS, each)
    assert [len(o.token_ids) for o in outs] == [5, 9, 13] and {o.finish_reason for o in outs} == {"length"}
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(CHATS, each[:2])


@pytest.mark.parametrize(("bad", "match"), [
    (dict(stop=5), "stop must be a list"), (dict(seed="a"), "seed must be an integer"),
    (dict(stop_token_ids=[10**6]), "stop_token_ids must be in"), (dict(max_tokens=-1), "max_tokens"),
])
def test_bad_sampling_params_are_clear_errors(llm: LLM, bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(CHATS[0], SamplingParams(**bad))
    assert llm.engine.num_running() == 0


def test_an_unknown_setting_names_the_known_ones() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument.*foo.*settings: tokenizer"):
        LLM(foo=1)


def test_bad_prompts_are_clear_errors(llm: LLM) -> None:
    assert llm.generate([], PARAMS) == []
    with pytest.raises(ValueError, match="single message dict"):
        llm.generate(CHATS[0][0], PARAMS)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], PARAMS)
    with pytest.raises(ValueError, match="context length"):
        llm.generate(CHATS[0], SamplingParams(max_tokens=10**6))
    assert llm.engine.num_running() == 0
