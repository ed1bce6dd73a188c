"""Incremental detokenization and stop strings (dflash_core/detokenize.py) on a real byte-level BPE tokenizer (a fast,
tokenizers-backed one: the ``DecodeStream`` path) and on a Python tokenizer (transformers' byte-level
``PerceiverTokenizer``, not a ``PreTrainedTokenizerFast``: the path that decodes a window twice per token)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dflash_core.detokenize import (
    IncrementalDetokenizer,
    RequestDecoder,
    StopMatcher,
    TokenStrings,
    _bytes_to_unicode,
)
from tests.helpers import make_tokenizer

TEXTS = [
    "Hello world! How are you today?",
    "日本語のテキストと中文字符，还有表情 😀🚀✨ and more emoji 🎉.",
    "def add(a, b):\n    return a + b\n",
    "é à ü — “quotes” 🇺🇳 👩‍👩‍👧 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def slow() -> Any:
    """A tokenizer of the other path: pure Python, one token per UTF-8 byte, no files."""
    from transformers import PerceiverTokenizer, PreTrainedTokenizerFast

    tokenizer = PerceiverTokenizer()
    assert not isinstance(tokenizer, PreTrainedTokenizerFast)
    return tokenizer


def byte_ids(tok: Any, text: str) -> list[int]:
    """One token per byte: every multi-byte character is split across tokens."""
    vocab = tok.get_vocab()
    table = _bytes_to_unicode()
    return [vocab[table[b]] for b in text.encode("utf-8")]


def stream(tok: Any, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt)
    pieces = [d.add_token(t) for t in ids]
    pieces.append(d.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split", ["bpe", "bytes"])
def test_incremental_equals_full_decode(tok: Any, text: str, split: str) -> None:
    ids = tok.encode(text, add_special_tokens=False) if split == "bpe" else byte_ids(tok, text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == text == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces), pieces  # a split character waits until complete
    if split == "bytes" and any(ord(c) > 127 for c in text):
        assert "" in pieces[:-1]  # some token completed no character on its own


def test_prompt_context_and_special_tokens(tok: Any) -> None:
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids = tok.encode("你好 😀<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tok, ids, prompt)) == "你好 😀"


def test_random_token_sequences_match_full_decode(tok: Any) -> None:
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        pieces = stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])  # never a character cut in two


def test_invalid_bytes_are_released(tok: Any) -> None:
    ids = byte_ids(tok, "a") + [tok.get_vocab()["ÿ"]] + byte_ids(tok, "b")  # 0xFF is never valid UTF-8
    assert "".join(stream(tok, ids)) == "a\ufffdb"
    d = IncrementalDetokenizer(tok)
    out = [d.add_token(t) for t in byte_ids(tok, "x😀")[:-1]]  # the emoji's last byte never comes
    assert "".join(out) == "x"
    assert d.flush() == "\ufffd"


@pytest.mark.parametrize("text", TEXTS)
def test_python_tokenizer_holds_split_characters(slow: Any, text: str) -> None:
    ids = slow.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))  # every multi-byte character is split across tokens
    pieces = stream(slow, ids)
    assert "".join(pieces) == text == slow.decode(ids)
    assert not any("\ufffd" in p for p in pieces), pieces  # a split character waits until complete
    if any(ord(c) > 127 for c in text):
        assert "" in pieces[:-1]


def test_python_tokenizer_random_bytes_and_invalid_ones(slow: Any) -> None:
    rng = random.Random(0)
    byte_id = slow.convert_tokens_to_ids  # chr(byte) -> its token
    for _ in range(200):
        ids = [byte_id(chr(rng.randrange(256))) for _ in range(rng.randrange(1, 30))]
        pieces = stream(slow, ids)
        assert "".join(pieces) == slow.decode(ids)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])  # never a character cut in two
    ids = [byte_id(c) for c in "a\xffb"]  # 0xFF is never valid UTF-8: released once the next byte shows it
    assert "".join(stream(slow, ids)) == "a\ufffdb"
    d = IncrementalDetokenizer(slow)
    out = [d.add_token(byte_id(chr(b))) for b in "x😀".encode()[:-1]]  # the emoji's last byte never comes
    assert "".join(out) == "x" and d.flush() == "\ufffd"


def test_python_tokenizer_stop_strings(slow: Any) -> None:
    ids = slow.encode("ab你好cd", add_special_tokens=False)
    dec = RequestDecoder(slow, slow.encode("prompt", add_special_tokens=False), ["好c"])
    first = dec.feed(ids[:4])
    assert (first.text, first.stop_string, first.tokens_used) == ("ab", None, 4)
    rest = dec.feed(ids[4:])
    assert (rest.text, rest.stop_string, rest.tokens_used) == ("你", "好c", 5)


def test_stop_matcher_holds_back_and_cuts() -> None:
    m = StopMatcher(["STOP", "\n\n"])
    assert m.push("abc S") == ("abc ", None)
    assert m.push("T") == ("", None)
    assert m.push("x") == ("STx", None)
    assert m.push("yy ST") == ("yy ", None)
    assert m.push("OP and more") == ("", "STOP")
    m = StopMatcher(["b", "abc"])
    assert m.push("xxabc") == ("xx", "abc")  # the earliest match wins
    m = StopMatcher(["END"])
    assert m.push("the EN") == ("the ", None)
    assert m.flush() == "EN"
    assert StopMatcher([]).push("anything") == ("anything", None)


def test_request_decoder_counts_tokens_up_to_the_stop(tok: Any) -> None:
    ids = byte_ids(tok, "ab你好cd")
    dec = RequestDecoder(tok, None, ["好c"])
    first = dec.feed(ids[:4])  # "ab" + first byte of 你
    assert (first.text, first.stop_string, first.tokens_used) == ("ab", None, 4)
    rest = dec.feed(ids[4:])
    # 你 completes at token 5; 好 (3 bytes) then "c" complete the stop string at token 9 of 10
    assert (rest.text, rest.stop_string, rest.tokens_used) == ("你", "好c", 5)
    assert dec.feed(ids).text == "" and dec.finish().text == ""


def test_request_decoder_releases_held_text_at_the_end(tok: Any) -> None:
    dec = RequestDecoder(tok, None, ["😀😀"])
    res = dec.feed(byte_ids(tok, "hi 😀"))
    assert (res.text, res.stop_string) == ("hi ", None)
    assert dec.finish().text == "😀"


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(tok: Any, text: str) -> None:
    strings = TokenStrings(tok)
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(strings.bytes(i) for i in ids) == text.encode("utf-8")
    assert strings.text(tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
