"""Draft checkpoint formats: which one a folder holds, its config as a `DraftConfig`, its weights by our names.

Two layouts load unchanged:

- **z-lab** (`architectures: ["DFlashDraftModel"]`, `dflash_config`): what z-lab publishes and `DFlashDraft.save`
  writes. The draft shares the target's embeddings and output head. `["DFlash2DraftModel"]` is a DFlash 2 draft:
  `dflash_config` adds its convolution and selector keys (`dflash_core.dflash2`).
- **speculators** (`speculators_model_type: "dflash"`): what the `speculators` library trains and vLLM reads. The
  Qwen3-style layers are described by `transformer_layer_config`; `aux_hidden_state_layer_ids` index the target's
  hidden states (hidden state a is the output of layer a - 1, so our target layer id is a - 1, as vLLM maps it);
  `block_size` and `mask_token_id` sit at top level. A reduced `draft_vocab_size` comes with the draft's own
  `lm_head.weight` [draft_vocab, H], `d2t` (target id = draft id + d2t[draft id]) and `t2d` (a bool mask over the
  target vocabulary). The layer tensors have z-lab's names. `speculators_model_type: "dflash2"` is a DFlash 2 draft,
  its keys at the top level or in a `dflash_config`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dflash_core.config import DFLASH2_ARCHITECTURE, DFLASH2_KEYS, DRAFT_ARCHITECTURE, DraftConfig

ZLAB, SPECULATORS = "z-lab", "speculators"
# Tensors a checkpoint may carry that the draft does not use: the target's embeddings, head and final norm (the
# draft runs the target's own), and t2d once it is checked against d2t.
UNUSED_TENSORS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d")


def config_path(folder: str | Path) -> Path:
    """`config.json` of a draft folder (or the file itself)."""
    path = Path(folder)
    return path / "config.json" if path.is_dir() else path


def draft_format(raw: dict[str, Any], where: str | Path) -> str:
    """ZLAB or SPECULATORS, or a ValueError saying what a config of either format carries."""
    if "speculators_model_type" in raw:
        return SPECULATORS
    archs = raw.get("architectures") or []
    if DRAFT_ARCHITECTURE in archs or DFLASH2_ARCHITECTURE in archs:
        return ZLAB
    raise ValueError(f"{where}: unknown draft format: no speculators_model_type (speculators format) and "
                     f"architectures is {archs}, expected ['{DRAFT_ARCHITECTURE}'] or ['{DFLASH2_ARCHITECTURE}'] "
                     f"(z-lab format)")


def read_draft_config(folder: str | Path) -> DraftConfig:
    """The `DraftConfig` of a draft folder in either format."""
    path = config_path(folder)
    raw = json.loads(path.read_text())
    if raw.get("quantization_config"):  # the draft's weights load as they are stored
        raise ValueError(f"{path}: the draft is quantized; drafts run in the target's compute dtype, from a "
                         "full-precision checkpoint")
    if draft_format(raw, path) == SPECULATORS:
        return speculators_config(raw, path)
    return DraftConfig.from_dict(raw)


def speculators_config(raw: dict[str, Any], where: str | Path = "config.json") -> DraftConfig:
    """Translate a speculators DFlash config; a variant this draft cannot run is a ValueError naming its field."""
    kind = raw.get("speculators_model_type")
    if kind not in ("dflash", "dflash2"):
        raise ValueError(f"{where}: speculators_model_type {kind!r} is not a DFlash draft (only 'dflash' and "
                         f"'dflash2' load)")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: speculators config lacks transformer_layer_config")
    refused = {
        "projector_type": (raw.get("projector_type", "dflash") != "dflash", "only the plain DFlash projector runs"),
        "sample_from_anchor": (bool(raw.get("sample_from_anchor")), "the first block row is the last token here"),
        "shift_label": (bool(raw.get("shift_label")), "block rows predict their own position here"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"{where}: {name}={raw.get(name)!r} is not supported: {why}")
    aux = raw.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"{where}: speculators config lacks aux_hidden_state_layer_ids")
    if min(aux) < 1:
        raise ValueError(f"{where}: aux_hidden_state_layer_ids {aux}: hidden state 0 (the embeddings) is no "
                         "layer's output")
    if raw.get("mask_token_id") is None:
        raise ValueError(f"{where}: speculators config lacks mask_token_id")
    hidden = layer.get("hidden_size")
    if raw.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"{where}: target_hidden_size {raw['target_hidden_size']} differs from the draft's "
                         f"hidden_size {hidden}: not supported")
    # vLLM lets top-level layer_types / sliding_window override the layer config's; speculators itself reads
    # layer_types only (no use_sliding_window switch)
    layer_types = raw.get("layer_types", layer.get("layer_types"))
    zlab = {k: v for k, v in layer.items() if k not in ("num_target_layers", "is_causal", "dflash_config")}
    zlab.update(
        layer_types=layer_types,
        sliding_window=raw.get("sliding_window", layer.get("sliding_window")),
        use_sliding_window=bool(layer_types) and "sliding_attention" in layer_types,
        # full-attention layers are bidirectional; sliding ones causal unless sliding_window_non_causal
        is_causal=False if raw.get("sliding_window_non_causal") else None,
        dflash_config={"mask_token_id": raw["mask_token_id"], "target_layer_ids": [int(a) - 1 for a in aux],
                       "block_size": raw.get("block_size", 8), **_dflash2_keys(raw)},
        draft_vocab_size=raw.get("draft_vocab_size"),
    )
    if kind == "dflash2":  # DFlash 2's convolution and selector: the z-lab architecture reads their keys
        zlab["architectures"] = [DFLASH2_ARCHITECTURE]
    return replace(DraftConfig.from_dict(zlab), num_target_layers=None)


def _dflash2_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A speculators config's DFlash 2 keys (conv_*, selector_*), at its top level or in a `dflash_config`."""
    nested = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    names = (*DFLASH2_KEYS, "input_embedding_scale", "output_multiplier", "final_logit_softcapping")
    found = {n: nested.get(n, raw.get(n)) for n in names}
    return {n: v for n, v in found.items() if v is not None}


def read_draft_weights(folder: str | Path, cfg: DraftConfig) -> dict[str, torch.Tensor]:
    """Every `*.safetensors` tensor of the folder under our names; the vocabulary map checked against `cfg`."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            state[k.removeprefix("model.")] = v
    if cfg.draft_vocab_size is None:  # the target's own head: a copy of it in the checkpoint is not needed
        state.pop("lm_head.weight", None)
        state.pop("d2t", None)
    else:
        check_vocab_map(folder, cfg, state)
    for name in UNUSED_TENSORS:
        state.pop(name, None)
    return state


def check_vocab_map(folder: str | Path, cfg: DraftConfig, state: dict[str, torch.Tensor]) -> None:
    """A reduced vocabulary needs its head and a d2t that maps it one-to-one into the target vocabulary."""
    n, vocab = int(cfg.draft_vocab_size or 0), cfg.vocab_size
    head, d2t, t2d = state.get("lm_head.weight"), state.get("d2t"), state.get("t2d")
    if head is None or d2t is None:
        raise ValueError(f"{folder}: draft_vocab_size {n} needs lm_head.weight and d2t in the weights")
    if tuple(head.shape) != (n, cfg.hidden_size) or tuple(d2t.shape) != (n,):
        raise ValueError(f"{folder}: draft_vocab_size {n}: lm_head.weight is {tuple(head.shape)} and d2t "
                         f"{tuple(d2t.shape)}, expected ({n}, {cfg.hidden_size}) and ({n},)")
    target_ids = torch.arange(n) + d2t.long()
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab or target_ids.unique().numel() != n:
        raise ValueError(f"{folder}: d2t does not map the {n} draft ids one-to-one into the target vocabulary "
                         f"({vocab})")
    if t2d is not None and (t2d.shape != (vocab,) or int(t2d.sum()) != n or not bool(t2d.bool()[target_ids].all())):
        raise ValueError(f"{folder}: t2d does not mark exactly the target ids d2t maps to")
    state["d2t"] = d2t.long()
