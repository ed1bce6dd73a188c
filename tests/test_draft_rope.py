"""The draft's RoPE equals transformers' for every scaling type, read from either config layout.

The draft's cos/sin are compared with transformers' own rotary modules built from a config with the same RoPE
parameters (YaRN and LongRoPE include the attention scaling on cos/sin; LongRoPE switches to its long factors past
`original_max_position_embeddings`). A YaRN draft in z-lab format then decodes exactly through the engine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from transformers.models.qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

from dflash_core.config import DraftConfig, EngineConfig
from dflash_core.draft import DFlashDraft
from dflash_core.layers import apply_rope
from dflash_core.loading import load_models
from dflash_core.sampling import SamplingParams
from tests.test_engine import run_all, tokens
from tests.test_loading import target_dir, write_zlab, zlab_config, zlab_weights  # noqa: F401 - target_dir: fixture

MAX_POS = 1024
ROPES = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
             "beta_slow": 1.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "mscale": 1.0,
                    "mscale_all_dim": 0.5},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 256,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 2.0},
}


def draft_config(raw_rope: dict[str, Any], **raw: Any) -> DraftConfig:
    """A tiny draft config (z-lab layout) with this RoPE."""
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=64, num_target_layers=4,
                  max_position_embeddings=MAX_POS, dflash_config={"mask_token_id": 3})
    return DraftConfig.from_dict({**fields, **raw_rope, **raw})


def draft_cos_sin(cfg: DraftConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    draft = DFlashDraft(cfg)
    return draft.rope(positions, torch.float32, positions.max(dim=1).values)


@pytest.mark.parametrize("name", sorted(ROPES))
@pytest.mark.parametrize("layout", ["rope_parameters", "rope_scaling"])
def test_cos_sin_equal_transformers(name: str, layout: str) -> None:
    """Both layouts: transformers 5's `rope_parameters` (theta inside) and the legacy `rope_scaling` + top-level
    `rope_theta` (type under `type`)."""
    params = ROPES[name]
    if layout == "rope_parameters":
        cfg = draft_config({"rope_parameters": {**params, "rope_theta": 10_000.0}})
    else:
        legacy = {("type" if k == "rope_type" else k): v for k, v in params.items()}
        cfg = draft_config({"rope_scaling": legacy, "rope_theta": 10_000.0})
    reference = Qwen3RotaryEmbedding(Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16,
                                                 max_position_embeddings=MAX_POS,
                                                 rope_parameters={**params, "rope_theta": 10_000.0}))
    # short contexts, and (LongRoPE's long factors) one past original_max_position_embeddings
    for positions in (torch.arange(0, 200)[None], torch.arange(100, 700)[None]):
        cos, sin = draft_cos_sin(cfg, positions)
        ref_cos, ref_sin = reference(torch.zeros(1), positions)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin), name
    if name.startswith(("yarn", "longrope")):
        assert reference.attention_scaling != 1.0  # the scaling on cos/sin is part of what is compared


def test_partial_rotary_default_equals_transformers() -> None:
    """partial_rotary_factor inside rope_parameters or at top level: only the first rotary_dim dims rotate."""
    params = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}
    top_level = {"partial_rotary_factor": 0.25, "rope_theta": 10_000.0}
    reference = Qwen3NextRotaryEmbedding(Qwen3NextConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                                         max_position_embeddings=MAX_POS, rope_parameters=params))
    positions = torch.arange(0, 1024)[None]
    ref_cos, ref_sin = reference(torch.zeros(1), positions)
    for cfg in (draft_config({"rope_parameters": params}), draft_config(top_level)):
        cos, sin = draft_cos_sin(cfg, positions)
        assert cos.shape == ref_cos.shape == (1, 1024, 4)
        # our default frequencies are computed in float64 (as before), transformers' in float32: 1 ulp apart
        torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-4)
        torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-4)
    x = torch.randn(1, 2, 1024, 16)
    rotated = apply_rope(x, cos, sin)
    assert torch.equal(rotated[..., 4:], x[..., 4:]) and not torch.allclose(rotated[..., :4], x[..., :4])


def test_plain_default_keeps_its_frequencies() -> None:
    cfg = draft_config({"rope_scaling": None, "rope_theta": 10_000.0})
    assert cfg.rope_scaling is None
    expected = (1.0 / (10_000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))).float()
    assert torch.equal(DFlashDraft(cfg).rope_frequencies.inv_freq, expected)


@pytest.mark.parametrize(
    ("rope", "field"),
    [
        ({"rope_parameters": {"rope_type": "made-up", "rope_theta": 1e4}}, r"rope_parameters\.rope_type"),
        ({"rope_scaling": {"type": "made-up", "factor": 2.0}}, r"rope_scaling\.type"),
        ({"rope_scaling": {"rope_type": "made-up"}}, r"rope_scaling\.rope_type"),
    ],
)
def test_unknown_rope_type_names_the_field(rope: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field + ".*unknown RoPE type 'made-up'"):
        draft_config(rope)


def test_dynamic_rope_is_the_base_set_within_the_length_and_one_scaled_set_past_it() -> None:
    """Dynamic NTK: within max_position_embeddings L the base frequencies (as transformers); past it the set
    transformers computes for a sequence of S = factor x L (base stretched by (factor * S / L - (factor - 1)) **
    (d / (d - 2))), the same for every request, as vLLM does."""
    cfg = draft_config({"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 10_000.0})
    d = cfg.head_dim
    freqs = lambda base: 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # noqa: E731
    draft = DFlashDraft(cfg)
    rope = draft.rope_frequencies
    torch.testing.assert_close(rope.inv_freq, freqs(10_000.0))
    torch.testing.assert_close(rope.long_inv_freq, freqs(10_000.0 * (2.0 * 2.0 - 1.0) ** (d / (d - 2))))
    pos = torch.tensor([[MAX_POS - 1], [MAX_POS]])
    cos, _ = draft.rope(pos, torch.float32, pos[:, 0])
    torch.testing.assert_close(cos[0, 0, : d // 2], torch.cos((MAX_POS - 1) * freqs(10_000.0)))
    torch.testing.assert_close(cos[1, 0, : d // 2], torch.cos(MAX_POS * draft.rope_frequencies.long_inv_freq))


def test_yarn_draft_decodes_exactly(target_dir, tmp_path) -> None:  # noqa: F811 - the fixture
    """A z-lab draft with YaRN (as z-lab's Qwen3.6 drafts) loads and gives plain decoding's greedy output."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1_000_000.0}
    draft_dir = write_zlab(tmp_path / "yarn", zlab_config(rope_scaling=None, rope_parameters=rope), zlab_weights())
    prompt = list(range(5, 75))  # past original_max_position_embeddings
    outs = []
    for draft in (str(draft_dir), None):
        models = load_models(EngineConfig(str(target_dir), draft, max_running_requests=2))
        rid = models.engine.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        outs.append(tokens(run_all(models.engine)[rid]))
    assert DFlashDraft.from_folder(draft_dir).rope_frequencies.attention_scaling > 1.0
    assert outs[0] == outs[1] and len(outs[0]) == 24
