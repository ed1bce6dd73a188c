"""What the draft takes from the target: its layer count, RoPE base, a mask token, the feature layers and the
draft's config."""

from __future__ import annotations

from typing import Any

from dflash_core.config import DraftConfig, build_target_layer_ids
from dflash_core.train.data import UsageError

MASK_NAMES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>")


def target_layers(model: Any) -> int:
    """The target's number of decoder layers."""
    return int(model.config.get_text_config().num_hidden_layers)


def rope_theta(cfg: Any) -> float:
    """The target's RoPE base (`rope_theta`, or `rope_parameters["rope_theta"]` on newer configs)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(getattr(cfg, "rope_theta", None) or params.get("rope_theta", 10000.0))


def resolve_mask_token(tok: Any, model: Any, requested: int | None) -> tuple[int, str | None]:
    """(mask id, note). Resizes the target's embeddings when a new token has to be added."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    if requested is not None:
        if not 0 <= requested < vocab:
            raise UsageError(f"--mask-token-id {requested} is outside the target vocabulary (0..{vocab - 1})")
        return requested, None
    for name in MASK_NAMES:
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tok.unk_token_id and 0 <= tid < vocab:
            return tid, None
    if len(tok) < vocab:
        return len(tok), f"mask token: unused id {len(tok)} (tokenizer has {len(tok)} tokens, model {vocab} rows)"
    tok.add_special_tokens({"additional_special_tokens": ["<|mask|>"]})
    model.resize_token_embeddings(len(tok), mean_resizing=True)
    return tok.convert_tokens_to_ids("<|mask|>"), (
        f"no free token id: added <|mask|> = {len(tok) - 1}; the target's vocabulary grew to {len(tok)}, "
        "so serve the resized target saved in OUTPUT/target_resized"
    )


def layer_ids_for(spec: str | None, num_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers whose hidden states feed the draft: `--target-layer-ids` or the z-lab rule."""
    if not spec:
        return build_target_layer_ids(num_layers, num_draft_layers)
    try:
        layer_ids = [int(x) for x in spec.split(",")]
    except ValueError:
        raise UsageError(f"--target-layer-ids must be comma-separated integers, got {spec!r}") from None
    if any(not 0 <= i < num_layers for i in layer_ids):
        raise UsageError(f"--target-layer-ids {layer_ids} outside the target's {num_layers} layers")
    return layer_ids


def draft_config(
    model: Any, *, num_layers: int, intermediate_size: int | None, block_size: int, mask_id: int, layer_ids: list[int]
) -> DraftConfig:
    """The draft's config: the target's width, heads, vocabulary and RoPE, with the draft's own depth and block."""
    tcfg = model.config.get_text_config()
    H = int(tcfg.hidden_size)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    return DraftConfig(
        hidden_size=H, intermediate_size=int(intermediate_size or tcfg.intermediate_size),
        num_hidden_layers=num_layers, num_attention_heads=int(tcfg.num_attention_heads),
        num_key_value_heads=int(getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads),
        head_dim=int(getattr(tcfg, "head_dim", None) or H // tcfg.num_attention_heads), vocab_size=vocab,
        num_target_layers=target_layers(model), block_size=block_size, mask_token_id=mask_id,
        target_layer_ids=layer_ids, rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta(tcfg), max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 4096)),
    )
