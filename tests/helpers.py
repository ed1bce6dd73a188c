"""Tiny model pairs and a tokenizer built in-process: no hub, a few seconds on a CPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_core.config import DraftConfig
from dflash_core.draft import DFlashDraft
from dflash_core.runners.base import Drafter, DraftRequest

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


def make_target(
    folder: str | Path | None,
    arch: str = "qwen3",
    vocab_size: int = 384,
    layers: int = 4,
    seed: int = 0,
):
    """A tiny random target with peaked logits (so greedy choices are far from ties), saved to `folder` (None: kept
    in memory only); arch qwen3, llama, qwen2, qwen3_moe, gpt_oss (sliding window 8), the hybrids qwen3_5,
    qwen3_5_moe and qwen3_next (Gated DeltaNet layers with every fourth layer full attention), or one of
    `GENERIC_ARCHS` (`generic_family_model`)."""
    from transformers import (
        AutoModelForCausalLM,
        GptOssConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

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
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4)
    configs = {
        "qwen3": (Qwen3Config, {}),
        "llama": (LlamaConfig, {}),
        "qwen2": (Qwen2Config, {}),
        "qwen3_moe": (Qwen3MoeConfig, dict(moe, decoder_sparse_step=1, norm_topk_prob=True)),
        "qwen3_5": (Qwen3_5TextConfig, linear),
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, dict(linear, **moe, shared_expert_intermediate_size=32)),
        "gpt_oss": (GptOssConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
        "qwen3_next": (Qwen3NextConfig, dict(linear, **moe, shared_expert_intermediate_size=32, decoder_sparse_step=1,
                                              partial_rotary_factor=0.25)),
    }
    if arch in GENERIC_ARCHS:
        model = generic_family_model(arch, common)
        if folder is not None:
            model.save_pretrained(str(folder))
        return model.eval()
    cls, extra = configs[arch]
    cfg = cls(**common, **extra)
    model = AutoModelForCausalLM.from_config(cfg)
    if folder is not None:
        model.save_pretrained(str(folder))
    return model.eval()


# families the generic runner serves that `make_target` builds from their own transformers configs
GENERIC_ARCHS = ("gemma4", "minimax_m2", "glm4_moe", "deepseek_v3", "kimi_k25", "mistral", "phi3", "phi3_longrope",
                 "glm_moe_dsa")


def generic_family_model(arch: str, common: dict[str, Any]) -> Any:
    """A tiny random model of one of `GENERIC_ARCHS`: gemma4 (text; sliding and full layers of different head dims,
    per-layer inputs, the last two layers reusing earlier keys, logit softcapping), minimax_m2 and glm4_moe (MoE),
    deepseek_v3 and kimi_k25 (MLA; Kimi K2.5 as the hub stores it, a vision tower beside a DeepSeek-V3 text model),
    mistral (sliding window 8), phi3 (fused projections), phi3_longrope (LongRoPE past 64 positions: its rotary
    embedding reads the largest position of a forward) and glm_moe_dsa (GLM-5: MLA with DeepSeek sparse attention)."""
    import transformers as tf
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vocab = common["vocab_size"]
    mla = dict(common, num_key_value_heads=common["num_attention_heads"], kv_lora_rank=32, q_lora_rank=32,
               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
               n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32, n_shared_experts=1)
    mla.pop("head_dim")
    if arch == "kimi_k25":
        from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

        vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
        cfg = Kimi_K25Config(text_config=dict(mla, model_type="deepseek_v3"), vision_config=vision,
                             tie_word_embeddings=False)
        return AutoModelForImageTextToText.from_config(cfg)
    configs = {
        "gemma4": lambda: tf.Gemma4TextConfig(
            **common, global_head_dim=32, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
            hidden_size_per_layer_input=16, vocab_size_per_layer_input=vocab, num_kv_shared_layers=2,
            final_logit_softcapping=30.0),
        "minimax_m2": lambda: tf.MiniMaxM2Config(**common, num_local_experts=4, num_experts_per_tok=2),
        "glm4_moe": lambda: tf.Glm4MoeConfig(
            **common, moe_intermediate_size=32, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True),
        "deepseek_v3": lambda: tf.DeepseekV3Config(**mla),
        # no padding row: a zero embedding scores every key 0 in the indexer, and transformers' top-k among equal
        # scores depends on the shape of the forward (docs/serving.md), so such a token would not test exactness
        "glm_moe_dsa": lambda: tf.GlmMoeDsaConfig(**dict(mla, pad_token_id=None), index_topk=8, index_head_dim=16,
                                                  index_n_heads=8),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=8),
        "phi3": lambda: tf.Phi3Config(**common),
        "phi3_longrope": lambda: tf.Phi3Config(**common, original_max_position_embeddings=64, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
            short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[2.0 + i for i in range(8)])),
    }
    return AutoModelForCausalLM.from_config(configs[arch]())


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


@dataclass
class RecordedState:
    """A wrapped drafter state, tagged with its request's prompt."""

    inner: Any
    prompt: tuple[int, ...]


@dataclass
class Proposal:
    """One proposal a drafter made: for the request with `prompt`, after `last_token` at `position`."""

    prompt: tuple[int, ...]
    last_token: int
    position: int
    tokens: list[int]


class RecordingDrafter(Drafter):
    """Wraps any Drafter through its public interface and records every proposal it returns to the engine.

    `check(inner_state, last_token, position, n)`, when given, runs before every proposal (an invariant to test).
    """

    def __init__(self, inner: Drafter, check: Callable[[Any, int, int, int], None] | None = None) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.max_slots = inner.max_slots
        self.prefix_cacheable = inner.prefix_cacheable
        self.check = check
        self.proposals: list[Proposal] = []

    def new_state(
        self, slot: int, prompt_token_ids: list[int], blocks: list[int] | None = None, cached: int = 0
    ) -> RecordedState:
        return RecordedState(self.inner.new_state(slot, prompt_token_ids, blocks, cached), tuple(prompt_token_ids))

    def context_written(self, state: RecordedState) -> int:
        return self.inner.context_written(state.inner)

    def extend_context(self, state: RecordedState, features: torch.Tensor) -> None:
        self.inner.extend_context(state.inner, features)

    def catch_up(self, states: Any) -> None:
        self.inner.catch_up([st.inner for st in states])

    def propose_batch(self, items: Sequence[DraftRequest]) -> list[list[int]]:
        inner_items = [DraftRequest(st.inner, last, pos, n) for st, last, pos, n in items]
        if self.check is not None:
            for item in inner_items:
                self.check(*item)
        outs = self.inner.propose_batch(inner_items)
        for (st, last, pos, _), tokens in zip(items, outs):
            self.proposals.append(Proposal(st.prompt, last, pos, list(tokens)))
        return outs

    def by_prompt(self, prompt: list[int] | tuple[int, ...]) -> list[Proposal]:
        """The proposals made for one request (prompts are assumed distinct), in order."""
        return [p for p in self.proposals if p.prompt == tuple(prompt)]


def noisy_demo_draft(folder: str | Path, scale: float, seed: int = 0) -> Path:
    """The demo draft with Gaussian noise on every weight (`scale` times each tensor's spread), saved to `folder`:
    the same shapes, other proposals."""
    from dflash_core.draft import DFlashDraft
    from dflash_core.loading import DEMO_DRAFT

    draft = DFlashDraft.from_folder(DEMO_DRAFT)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp_min(1e-3))
    draft.save(folder)
    return Path(folder)
