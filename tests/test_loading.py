"""A draft folder in the exact z-lab format loads and runs; a draft that does not fit its target fails at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_core.config import DraftConfig, EngineConfig, build_target_layer_ids
from dflash_core.loading import load_models
from dflash_core.sampling import SamplingParams
from tests.helpers import make_tiny_pair


def zlab_config(**overrides) -> dict:
    """A config.json with the field names of z-lab/Qwen3-8B-DFlash-b16, scaled down to the tiny target."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16,
        "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 2]},
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 40960,
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 384,
    }
    cfg.update(overrides)
    return cfg


def zlab_weights(layers: int = 2, hidden: int = 64, inter: int = 128, n_ids: int = 2) -> dict[str, torch.Tensor]:
    """Weights under z-lab's tensor names (bf16, as published)."""
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    state = {"fc.weight": w(hidden, n_ids * hidden), "hidden_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             "norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": w(64, hidden),
            p + "self_attn.k_proj.weight": w(32, hidden),
            p + "self_attn.v_proj.weight": w(32, hidden),
            p + "self_attn.o_proj.weight": w(hidden, 64),
            p + "self_attn.q_norm.weight": torch.ones(16, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(16, dtype=torch.bfloat16),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
    return state


def write_zlab(folder: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_pair(tmp_path_factory.mktemp("zlab"))[0]


def test_zlab_rule_for_layer_ids():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16
    assert build_target_layer_ids(28, 1) == [14]


def test_block_size_at_top_level_or_in_dflash_config():
    top = DraftConfig.from_dict(zlab_config())
    nested = zlab_config(dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 2], "block_size": 8})
    del nested["block_size"]
    assert top.block_size == 16 and DraftConfig.from_dict(nested).block_size == 8
    no_ids = zlab_config(dflash_config={"mask_token_id": 3})
    assert DraftConfig.from_dict(no_ids).target_layer_ids == build_target_layer_ids(4, 2)


def test_zlab_folder_loads_and_decodes_losslessly(target_dir, tmp_path):
    draft_dir = write_zlab(tmp_path / "zlab-draft", zlab_config(), zlab_weights())
    models = load_models(EngineConfig(str(target_dir), str(draft_dir), speculation="fixed"))  # it must draft
    plain = load_models(EngineConfig(str(target_dir), None))
    assert models.block_size == 16 and plain.block_size == 1
    outs = []
    for engine in (models.engine, plain.engine):
        rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=24, ignore_eos=True))
        toks = []
        while engine.has_unfinished():
            toks += [t for o in engine.step() for t in o.new_token_ids]
        outs.append(toks)
        assert engine.stats(rid).generated_tokens == 24
    assert outs[0] == outs[1]
    assert models.engine.stats(0).num_drafts > 0


def test_sliding_window_layers_run(target_dir, tmp_path):
    cfg = zlab_config(layer_types=["sliding_attention", "full_attention"], sliding_window=4, use_sliding_window=True)
    draft_dir = write_zlab(tmp_path / "swa-draft", cfg, zlab_weights())
    models = load_models(EngineConfig(str(target_dir), str(draft_dir)))
    models.engine.add_request(list(range(4, 40)), SamplingParams(max_tokens=20))
    while models.engine.has_unfinished():
        models.engine.step()


@pytest.mark.parametrize(
    ("overrides", "weights", "field"),
    [
        ({"hidden_size": 32}, None, "hidden_size"),
        ({"vocab_size": 999}, None, "vocab_size"),
        ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 7]}}, None, "target_layer_ids"),
        ({"dflash_config": {"mask_token_id": 5000, "target_layer_ids": [1, 2]}}, None, "mask_token_id"),
        ({"architectures": ["Qwen3ForCausalLM"]}, None, "architectures"),
        ({}, {"fc.weight": torch.zeros(64, 128)}, "weights"),
    ],
)
def test_mismatched_pair_fails_naming_the_field(target_dir, tmp_path, overrides, weights, field):
    draft_dir = write_zlab(tmp_path / "bad", zlab_config(**overrides), weights or zlab_weights())
    with pytest.raises(ValueError, match=field):
        load_models(EngineConfig(str(target_dir), str(draft_dir)))


def test_missing_folder_is_a_clear_error(target_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local folder"):
        load_models(EngineConfig(str(target_dir), str(tmp_path / "no-such-draft")))
