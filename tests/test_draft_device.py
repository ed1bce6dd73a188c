"""All of the draft's state moves with `.to(device)`: every tensor a module holds is a parameter or a buffer (a
compiled step must find no tensor left behind on the CPU), and the RoPE frequencies stay float32 under
`.to(dtype)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from dflash_core.config import DraftConfig
from dflash_core.draft import DFlashDraft

LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 256, "rope_theta": 10_000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}


def _draft(**rope: Any) -> DFlashDraft:
    cfg = DraftConfig.from_dict(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
                                     num_target_layers=4, max_position_embeddings=1024, draft_vocab_size=32,
                                     dflash_config={"mask_token_id": 3}, **rope))
    return DFlashDraft(cfg)


def _loose_tensors(value: Any, path: str, seen: set[int]) -> Iterator[str]:
    """Paths of the tensors inside an attribute's value (containers and dataclasses included)."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _loose_tensors(v, f"{path}[{k!r}]", seen)
    elif isinstance(value, list | tuple | set):
        for i, v in enumerate(value):
            yield from _loose_tensors(v, f"{path}[{i}]", seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _loose_tensors(getattr(value, f.name), f"{path}.{f.name}", seen)


def _not_registered(model: torch.nn.Module) -> list[str]:
    """Tensors reachable from a module's attributes that are neither parameters nor buffers."""
    loose: list[str] = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr not in ("_parameters", "_buffers", "_modules"):
                loose += _loose_tensors(value, f"{name or 'draft'}.{attr}", set())
    return loose


def test_every_tensor_is_a_parameter_or_buffer() -> None:
    for draft in (_draft(), _draft(rope_parameters=LONGROPE)):
        assert _not_registered(draft) == []
        buffers = dict(draft.named_buffers())
        assert "_inv_freq" in buffers and "_inv_freq" not in draft.state_dict()  # not in checkpoints


def test_to_device_moves_everything_and_keeps_rope_float32() -> None:
    draft = _draft(rope_parameters=LONGROPE)
    expected = draft.rope_frequencies
    moved = draft.to("meta")
    left = [n for n, t in (*moved.named_parameters(), *moved.named_buffers()) if t.device.type != "meta"]
    assert left == []
    assert moved._long_inv_freq is not None and moved._long_inv_freq.device.type == "meta"

    half = _draft(rope_parameters=LONGROPE).to(torch.bfloat16)
    rope = half.rope_frequencies
    assert half.fc.weight.dtype == torch.bfloat16 and half.d2t.dtype == torch.long
    assert rope.inv_freq.dtype == torch.float32 and rope.long_inv_freq.dtype == torch.float32
    assert torch.equal(rope.inv_freq, expected.inv_freq) and torch.equal(rope.long_inv_freq, expected.long_inv_freq)
    assert rope.attention_scaling == expected.attention_scaling != 1.0
