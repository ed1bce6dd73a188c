"""Reasoning parsers on scripted model text: the split is the same whether the text comes whole or in pieces (every
piece boundary, including inside ``</think>``), for both styles and every place the prompt leaves the thinking; the
thinking budget of a required / named tool choice's grammar."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dflash_core.grammar import LLGuidanceBackend, StructuredOutput
from dflash_core.loading import DEMO_TARGET
from dflash_core.tool_grammar import tool_call_structure
from server.reasoning import (
    DeepSeekR1Style,
    PromptThinking,
    Qwen3Style,
    ReasoningDelta,
    prompt_thinking,
    reasoning_style,
)

QWEN3_OUTPUT = "<think>\nLet me add: 2 + 2.\n</think>\n\nThe answer is 4."


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def streamed(style: Qwen3Style | DeepSeekR1Style, thinking: PromptThinking, parts: list[str]) -> ReasoningDelta:
    splitter = style.splitter(thinking)
    out = ReasoningDelta()
    for part in parts:
        out = out + splitter.feed(part)
    return out + splitter.finish()


def test_prompt_thinking_reads_the_end_of_the_prompt() -> None:
    assert prompt_thinking("<|im_start|>assistant\n<think>\n") is PromptThinking.OPEN
    assert prompt_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n") is PromptThinking.CLOSED
    assert prompt_thinking("<|im_start|>assistant\n") is PromptThinking.NONE


def test_qwen3_whole_output() -> None:
    whole = Qwen3Style().splitter(PromptThinking.NONE).split(QWEN3_OUTPUT)
    assert whole == ReasoningDelta("\nLet me add: 2 + 2.\n", "\n\nThe answer is 4.")


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 11])
def test_qwen3_split_inside_any_piece_equals_the_whole(step: int) -> None:
    whole = Qwen3Style().splitter(PromptThinking.NONE).split(QWEN3_OUTPUT)
    parts = pieces(QWEN3_OUTPUT, list(range(step, len(QWEN3_OUTPUT), step)))
    assert streamed(Qwen3Style(), PromptThinking.NONE, parts) == whole


def test_one_piece_carries_the_end_of_the_reasoning_and_the_answer() -> None:
    splitter = Qwen3Style().splitter(PromptThinking.OPEN)  # Qwen3.5: the prompt opened the thinking
    assert splitter.feed("I think") == ReasoningDelta("I think", "")
    assert splitter.feed(" hard</th") == ReasoningDelta(" hard", "")  # "</th" is held: it may be the marker
    assert splitter.feed("ink>\n\nFour") == ReasoningDelta("", "\n\nFour")
    assert splitter.feed(".") == ReasoningDelta("", ".")
    assert splitter.finish() == ReasoningDelta()


def test_qwen3_without_thinking_is_all_content() -> None:
    assert Qwen3Style().splitter(PromptThinking.NONE).split("Just 4. a < b") == ReasoningDelta("", "Just 4. a < b")
    closed = Qwen3Style().splitter(PromptThinking.CLOSED)
    assert closed.split("4 <think> is text here") == ReasoningDelta("", "4 <think> is text here")


def test_a_held_marker_start_that_never_completes_is_text() -> None:
    splitter = Qwen3Style().splitter(PromptThinking.OPEN)
    assert splitter.feed("a </thi") == ReasoningDelta("a ", "")
    assert splitter.finish() == ReasoningDelta("</thi", "")


def test_deepseek_r1_starts_in_the_reasoning() -> None:
    style = reasoning_style("deepseek_r1")
    text = "<think>\nHmm.\n</think>\n\nYes."
    whole = style.splitter(PromptThinking.NONE).split(text)
    assert whole == ReasoningDelta("\nHmm.\n", "\n\nYes.")
    assert streamed(style, PromptThinking.NONE, list(text)) == whole
    assert style.splitter(PromptThinking.OPEN).split("Hmm.</think>Yes.") == ReasoningDelta("Hmm.", "Yes.")
    assert style.splitter(PromptThinking.NONE).split("still thinking") == ReasoningDelta("still thinking", "")
    assert style.splitter(PromptThinking.CLOSED).split("Yes.") == ReasoningDelta("", "Yes.")


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        reasoning_style("granite")


# --- the thinking budget of a required / named tool choice (its grammar covers the thinking) ---------------------

CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def backend() -> LLGuidanceBackend:
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    return LLGuidanceBackend(tokenizer, len(tokenizer))


def accepts(backend: LLGuidanceBackend, structured: StructuredOutput, text: str) -> bool:
    """Whether the grammar allows ``text`` token by token, then the stop token (the demo's EOS)."""
    eos = backend.tokenizer.eos_token_id
    matcher = backend.matcher(structured, [eos])
    ids = [*backend.tokenizer.encode(text, add_special_tokens=False), eos]
    return all(bool(matcher.allowed()[t]) and matcher.accept(t) for t in ids)


def test_forced_tool_grammar_ends_the_thinking_after_its_budget(backend: LLGuidanceBackend) -> None:
    opened = tool_call_structure(TOOLS, "hermes", thinking_budget=20, thinking_open=True)
    assert accepts(backend, opened, "Let me see.</think>\n\n" + CALL)
    assert accepts(backend, opened, "x" * 20 + "</think>" + CALL)
    assert not accepts(backend, opened, "x" * 21 + "</think>" + CALL)  # past the budget only </think> is allowed
    assert not accepts(backend, opened, CALL)  # the thinking must end first
    matcher = backend.matcher(opened, [backend.tokenizer.eos_token_id])
    for t in backend.tokenizer.encode("y" * 20, add_special_tokens=False):
        assert matcher.accept(t)
    allowed = [backend.tokenizer.decode([t]) for t in matcher.allowed().nonzero().flatten().tolist()]
    assert allowed and all("</think>".startswith(a) for a in allowed)
    optional = tool_call_structure(TOOLS, "hermes", thinking_budget=20, thinking_open=False)
    assert accepts(backend, optional, CALL) and accepts(backend, optional, "<think>hm</think>\n" + CALL)
    assert not accepts(backend, optional, "hm</think>" + CALL)


def test_markers_held_as_one_token_are_that_token_in_the_grammar() -> None:
    """Qwen's tokenizer holds ``<think>``, ``</think>``, ``<tool_call>`` and ``</tool_call>`` as single added
    tokens: the grammar allows those tokens (the model's own way of writing them), with the same budget."""
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    markers = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    tokenizer.add_tokens(markers)
    marker_ids = dict(zip(markers, tokenizer.convert_tokens_to_ids(markers), strict=True))
    backend = LLGuidanceBackend(tokenizer, len(tokenizer))
    encoded = tokenizer.encode("<think>hm</think>\n" + CALL, add_special_tokens=False)
    assert set(marker_ids.values()) <= set(encoded)  # the text is written with the marker tokens
    optional = tool_call_structure(TOOLS, "hermes", thinking_budget=20, thinking_open=False, marker_ids=marker_ids)
    assert accepts(backend, optional, "<think>hm</think>\n" + CALL) and accepts(backend, optional, CALL)
    opened = tool_call_structure(TOOLS, "hermes", thinking_budget=20, thinking_open=True, marker_ids=marker_ids)
    assert accepts(backend, opened, "x" * 20 + "</think>" + CALL)
    assert not accepts(backend, opened, "x" * 21 + "</think>" + CALL)
