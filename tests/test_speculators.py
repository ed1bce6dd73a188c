"""Drafts in the speculators format (what vLLM reads) load unchanged, propose target ids and decode exactly.

The test drafts use the field and tensor names of published speculators DFlash checkpoints: `speculators_model_type`,
`transformer_layer_config`, `aux_hidden_state_layer_ids` (hidden-state indices: our target layer id is one less),
top-level `block_size` / `mask_token_id` / `draft_vocab_size`, z-lab's layer tensor names, and for a reduced
vocabulary the draft's own `lm_head.weight` with `d2t` (target id = draft id + d2t[draft id]) and `t2d`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from dflash_core.config import EngineConfig
from dflash_core.draft_formats import read_draft_config
from dflash_core.engine import Engine
from dflash_core.loading import load_models
from dflash_core.sampling import SamplingParams
from tests.helpers import RecordingDrafter, make_tiny_pair
from tests.test_draft_reference import reference_logits
from tests.test_engine import run_all, tokens
from tests.test_loading import zlab_weights

DRAFT_VOCAB = 96


def speculators_config(vocab: int, **overrides: Any) -> dict[str, Any]:
    """A config.json in the layout the speculators library saves (scaled down to the tiny target)."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"": "config.DFlashSpeculatorConfig"},
        "aux_hidden_state_layer_ids": [2, 3],
        "block_size": 8,
        "draft_vocab_size": DRAFT_VOCAB,
        "dtype": "bfloat16",
        "mask_token_id": 3,
        "projector_type": "dflash",
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 7,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "tiny-target"},
        },
        "speculators_model_type": "dflash",
        "speculators_version": "0.5.0",
        "target_hidden_size": None,
        "transformer_layer_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "head_dim": 16,
            "hidden_act": "silu",
            "hidden_size": 64,
            "intermediate_size": 128,
            "max_position_embeddings": 1024,
            "model_type": "qwen3",
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "vocab_size": vocab,
        },
        "transformers_version": "4.57.6",
    }
    cfg.update(overrides)
    return cfg


def vocab_map(vocab: int, n: int = DRAFT_VOCAB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target ids of the draft vocabulary, d2t, t2d): a scattered subset of the target vocabulary."""
    target_ids = torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(4))[:n]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids, target_ids - torch.arange(n), t2d


def write_speculators(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def reduced_weights(vocab: int) -> dict[str, torch.Tensor]:
    _, d2t, t2d = vocab_map(vocab)
    head = (torch.randn(DRAFT_VOCAB, 64, generator=torch.Generator().manual_seed(5)) * 0.5).to(torch.bfloat16)
    return {**zlab_weights(), "lm_head.weight": head, "d2t": d2t, "t2d": t2d}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> tuple[Path, int]:
    folder = make_tiny_pair(tmp_path_factory.mktemp("spec"))[0]
    return folder, json.loads((folder / "config.json").read_text())["vocab_size"]


def test_config_fields_are_translated(target, tmp_path) -> None:
    _, vocab = target
    (tmp_path / "config.json").write_text(json.dumps(speculators_config(vocab)))
    cfg = read_draft_config(tmp_path)
    assert cfg.target_layer_ids == [1, 2]  # hidden states 2 and 3 are the outputs of layers 1 and 2
    assert (cfg.block_size, cfg.mask_token_id, cfg.draft_vocab_size, cfg.vocab_size) == (8, 3, DRAFT_VOCAB, vocab)
    assert (cfg.num_hidden_layers, cfg.head_dim, cfg.rope_theta, cfg.num_target_layers) == (2, 16, 1e6, None)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_reduced_vocabulary_draft_proposes_target_ids_and_stays_exact(target, tmp_path, backend: str) -> None:
    target_dir, vocab = target
    draft_dir = write_speculators(tmp_path / "spec", speculators_config(vocab), reduced_weights(vocab))
    models = load_models(EngineConfig(str(target_dir), str(draft_dir), backend=backend, max_running_requests=2))
    plain = load_models(EngineConfig(str(target_dir), None, backend=backend))
    draft = models.engine.drafter.draft
    recorder = RecordingDrafter(models.engine.drafter)
    engine = Engine(models.engine.target, recorder, eos_token_ids=[], max_slots=2)
    prompts = [list(range(5, 25)), list(range(40, 47))]
    outs = []
    for eng in (engine, plain.engine):
        ids = [eng.add_request(p, SamplingParams(max_tokens=20)) for p in prompts]
        steps = run_all(eng)
        outs.append([tokens(steps[rid]) for rid in ids])
    assert outs[0] == outs[1]
    target_ids, _, _ = vocab_map(vocab)
    proposed = [t for p in recorder.proposals for t in p.tokens]
    assert proposed and set(proposed) <= set(target_ids.tolist())
    assert max(proposed) >= DRAFT_VOCAB  # target ids, not draft ids
    # each proposal is the draft's argmax over its own vocabulary, mapped through d2t
    draft_id = {int(t): i for i, t in enumerate(target_ids)}
    sequences = {tuple(p): out for p, out in zip(prompts, outs[0])}
    for prop in recorder.proposals:
        seq = list(prop.prompt) + sequences[prop.prompt]
        logits = reference_logits(plain.engine.target.model, draft, seq[: prop.position], prop.last_token,
                                  len(prop.tokens))
        assert logits.shape[-1] == DRAFT_VOCAB
        for k, tok in enumerate(prop.tokens):
            assert float(logits[k, draft_id[tok]]) >= float(logits[k].max()) - 1e-3


def test_full_vocabulary_draft_with_sliding_layers(target, tmp_path) -> None:
    """No reduced vocabulary: the target's head; top-level layer_types (vLLM lets them override) with a window."""
    target_dir, vocab = target
    config = speculators_config(vocab, draft_vocab_size=vocab, layer_types=["sliding_attention", "full_attention"],
                                sliding_window=4)
    draft_dir = write_speculators(tmp_path / "full", config, zlab_weights())
    models = load_models(EngineConfig(str(target_dir), str(draft_dir)))
    draft = models.engine.drafter.draft
    assert draft.lm_head is None and draft.d2t is None
    assert [layer.self_attn.sliding_window for layer in draft.layers] == [4, None]
    assert [layer.self_attn.is_causal for layer in draft.layers] == [True, False]
    plain = load_models(EngineConfig(str(target_dir), None))
    outs = []
    for eng in (models.engine, plain.engine):
        rid = eng.add_request(list(range(5, 30)), SamplingParams(max_tokens=16))
        outs.append(tokens(run_all(eng)[rid]))
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    ("overrides", "tensors", "message"),
    [
        ({"speculators_model_type": "eagle3"}, None, "speculators_model_type 'eagle3'"),
        ({"speculators_model_type": None, "architectures": ["Qwen3ForCausalLM"]}, None, "unknown draft format"),
        ({"aux_hidden_state_layer_ids": None}, None, "aux_hidden_state_layer_ids"),
        ({"sample_from_anchor": True}, None, "sample_from_anchor"),
        ({"projector_type": "domino"}, None, "projector_type"),
        ({"target_hidden_size": 128}, None, "target_hidden_size"),
        ({}, {"d2t": torch.full((DRAFT_VOCAB,), 10_000)}, "d2t does not map"),
        ({}, {"lm_head.weight": None}, "needs lm_head.weight"),
    ],
)
def test_bad_speculators_drafts_fail_clearly(target, tmp_path, overrides, tensors, message) -> None:
    target_dir, vocab = target
    config = speculators_config(vocab, **overrides)
    if config["speculators_model_type"] is None:
        del config["speculators_model_type"]
    weights = reduced_weights(vocab)
    for name, value in (tensors or {}).items():
        if value is None:
            weights.pop(name)
        else:
            weights[name] = value
    draft_dir = write_speculators(tmp_path / "bad", config, weights)
    with pytest.raises(ValueError, match=message):
        load_models(EngineConfig(str(target_dir), str(draft_dir)))
