"""Tiny model pairs and a tokenizer built in-process: no hub, a few seconds on a CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_core.config import DraftConfig
from dflash_core.draft import DFlashDraft

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 12 + 30 = 42.",
    "def add(a, b):\n    return a + b\n",
    "Hello world! How are you today? I am fine, thank you.",
    "日本語のテキストと中文字符，还有表情 😀🚀✨ and more emoji 🎉.",
    "Unit conversions: 1 km = 1000 m; 3 feet is about 0.9144 metres.",
] * 20


def make_tokenizer(folder: str | Path, vocab_size: int = 384):
    """Byte-level BPE with ChatML special tokens and a mask token, saved as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|mask|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def make_target(folder: str | Path, arch: str = "qwen3", vocab_size: int = 384, layers: int = 4, seed: int = 0):
    """A tiny random target with peaked logits (so greedy choices are far from ties), saved to `folder`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    cfg = Qwen3Config(**common) if arch == "qwen3" else LlamaConfig(**common)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(folder))
    return model.eval()


def make_draft(folder: str | Path, target_layers: int = 4, vocab_size: int = 384, block_size: int = 16, seed: int = 1):
    """A random DFlash draft in z-lab format for a `make_target` model."""
    torch.manual_seed(seed)
    cfg = DraftConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab_size,
        num_target_layers=target_layers,
        block_size=block_size,
        mask_token_id=3,
        max_position_embeddings=1024,
    )
    draft = DFlashDraft(cfg)
    draft.save(folder)
    return draft


def make_tiny_pair(tmp_dir: str | Path, arch: str = "qwen3", block_size: int = 16) -> tuple[Path, Path]:
    """(target_dir, draft_dir): a tiny random target with a tokenizer, and a random draft for it."""
    tmp_dir = Path(tmp_dir)
    target_dir, draft_dir = tmp_dir / f"target-{arch}", tmp_dir / f"draft-{arch}-b{block_size}"
    tok = make_tokenizer(target_dir)
    vocab = len(tok)
    make_target(target_dir, arch=arch, vocab_size=vocab)
    make_draft(draft_dir, vocab_size=vocab, block_size=block_size)
    return target_dir, draft_dir
