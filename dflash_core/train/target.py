"""What the draft takes from the target: its layer count, RoPE, MLP width, a mask token, the feature layers and the
draft's config.

Every target family transformers loads as a causal LM works the same way: dense (Qwen3, Llama, Qwen2), MoE
(Qwen3-MoE, gpt-oss), and hybrids with Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next). The draft reads
only the target's residual stream (hidden states), embeddings and head, so the kind of token mixer or MLP a target
layer has does not matter; what the draft copies from the target's (text) config is its width, heads, vocabulary,
RoPE base and type (`draft_rope`) and MLP width (`mlp_width`)."""

from __future__ import annotations

from typing import Any

from dflash_core.config import DraftConfig, build_target_layer_ids
from dflash_core.layers import rope_inv_freq
from dflash_core.train.data import UsageError

MASK_NAMES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>")


def target_layers(model: Any) -> int:
    """The target's number of decoder layers."""
    return int(model.config.get_text_config().num_hidden_layers)


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """The target's RoPE parameters (`rope_parameters`, or `rope_scaling` on older configs); a config with one set
    per attention type (`{"full_attention": {...}, "sliding_attention": {...}}`) gives its full-attention set."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    return params


def rope_theta(cfg: Any) -> float:
    """The target's RoPE base (`rope_theta`, or `rope_parameters["rope_theta"]` on newer configs)."""
    return float(getattr(cfg, "rope_theta", None) or rope_parameters(cfg).get("rope_theta", 10000.0))


# what the draft's RoPE does not take from the target's parameters: the base is its own field, and the draft
# rotates every dimension of a head (multimodal sections coincide with 1-D RoPE on text positions)
_NOT_SCALING = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def draft_rope(cfg: Any, head_dim: int) -> tuple[float, dict[str, Any] | None, str | None]:
    """(theta, rope_scaling, note) of the draft: the target's base and RoPE type, over the whole head (the draft is
    Qwen3-style, full rotary, whatever the target's `partial_rotary_factor`). A RoPE type the draft does not
    implement (`dflash_core.layers.rope_inv_freq` refuses it) falls back to the default RoPE with the target's
    base, and the note says so."""
    theta = rope_theta(cfg)
    params = rope_parameters(cfg)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return theta, None, None
    scaling = {k: v for k, v in params.items() if k not in _NOT_SCALING}
    scaling["rope_type"] = kind
    try:
        rope_inv_freq(head_dim, theta, scaling)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return theta, None, (f"the draft does not support the target's RoPE type {kind!r} ({exc}): it uses the "
                             f"default RoPE with the target's theta {theta:g}")
    return theta, scaling, None


def mlp_width(cfg: Any) -> tuple[int, str | None]:
    """(draft MLP width, note): the target's `intermediate_size` when its config has one (for gpt-oss that is an
    expert's width; no note); else, for MoE configs without one (Qwen3.5-MoE), the width a token's MLP activates:
    `moe_intermediate_size * num_experts_per_tok + shared_expert_intermediate_size`; else 3 x `hidden_size`. The
    note says which fallback was taken."""
    if getattr(cfg, "intermediate_size", None):
        return int(cfg.intermediate_size), None
    per_expert, top_k = getattr(cfg, "moe_intermediate_size", None), getattr(cfg, "num_experts_per_tok", None)
    if per_expert and top_k:
        shared = int(getattr(cfg, "shared_expert_intermediate_size", None) or 0)
        width = int(per_expert) * int(top_k) + shared
        return width, (f"draft MLP width {width}: the target has no intermediate_size, so its active MoE width, "
                       f"moe_intermediate_size {per_expert} x num_experts_per_tok {top_k} + "
                       f"shared_expert_intermediate_size {shared}")
    width = 3 * int(cfg.hidden_size)
    return width, f"draft MLP width {width}: 3 x the target's hidden_size (its config has no MLP width)"


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
) -> tuple[DraftConfig, list[str]]:
    """(the draft's config, notes to log): the target's width, heads, vocabulary, RoPE and MLP width (`mlp_width`,
    unless `intermediate_size` is given), with the draft's own depth and block. Notes say what was not copied as is."""
    tcfg = model.config.get_text_config()
    H = int(tcfg.hidden_size)
    heads = int(tcfg.num_attention_heads)
    # a heterogeneous config (Gemma 4: a head dim per layer) refuses the global attribute; its dict holds it
    head_dim = int(tcfg.to_dict().get("head_dim") or H // heads)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    notes: list[str] = []
    if intermediate_size is None:
        intermediate_size, mlp_note = mlp_width(tcfg)
        if mlp_note:
            notes.append(mlp_note)
    theta, scaling, rope_note = draft_rope(tcfg, head_dim)
    if rope_note:
        notes.append(rope_note)
    cfg = DraftConfig(
        hidden_size=H, intermediate_size=int(intermediate_size), num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=int(getattr(tcfg, "num_key_value_heads", None) or heads),
        head_dim=head_dim, vocab_size=vocab, num_target_layers=target_layers(model), block_size=block_size,
        mask_token_id=mask_id, target_layer_ids=layer_ids, rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", None) or 4096),
    )
    return cfg, notes
