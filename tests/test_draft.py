"""The draft's cached, incremental context gives the same block hidden states as one full pass."""

from __future__ import annotations

import torch

from dflash_core.config import DraftConfig
from dflash_core.draft import DFlashDraft
from dflash_core.draft_cache import DraftKVCache


def test_incremental_context_equals_full_pass():
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50, num_target_layers=6, block_size=4, mask_token_id=1)
    draft = DFlashDraft(cfg).eval()
    feats = torch.randn(1, 30, len(cfg.target_layer_ids) * 32)
    block = torch.randn(1, 4, 32)
    block_pos = torch.arange(30, 34)[None]
    full = draft(block, block_pos, feats, torch.arange(30)[None])
    cache = DraftKVCache(2)
    for lo, hi in ((0, 11), (11, 12), (12, 30)):  # context arrives in pieces, as accepted prefixes do
        part = draft(block, block_pos, feats[:, lo:hi], torch.arange(lo, hi)[None], cache)
    assert cache.length == 30
    torch.testing.assert_close(part, full, rtol=1e-5, atol=1e-5)
    # block queries are bidirectional: the first row depends on the last
    changed = block.clone()
    changed[0, 3] += 1.0
    assert not torch.allclose(draft(changed, block_pos, feats, torch.arange(30)[None])[0, 0], full[0, 0])
