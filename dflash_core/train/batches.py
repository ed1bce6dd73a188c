"""The training batch: the target's context features, random anchor blocks with their visibility mask, and the
weighted block loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def context_features(model: Any, ids: torch.Tensor, att: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Concatenated hidden states `output_hidden_states[i+1]` of the chosen layers: [b, s, len(ids)*H].

    The same for every family (dense, MoE, Gated DeltaNet hybrids, sliding-window attention): rows are right-padded,
    so a row's real positions never see its padding (causal attention; recurrences run left to right), and the
    features equal what the serving runners hand the draft (tests/test_train_families.py checks each family)."""
    out = model(input_ids=ids, attention_mask=att, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)


def make_block_batch(
    seqs: list[torch.Tensor], resp_starts: list[int], block_size: int, n_anchors: int, mask_id: int,
    pad_id: int, gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Anchors, block tokens/positions, labels, loss weights and the [b,1,q,S+q] visibility mask for a batch."""
    b, B = len(seqs), block_size
    S = max(len(s) for s in seqs)
    tokens = torch.full((b, S), pad_id, dtype=torch.long)
    att = torch.zeros((b, S), dtype=torch.long)
    anchors = torch.zeros((b, n_anchors), dtype=torch.long)
    valid = torch.zeros((b, n_anchors), dtype=torch.bool)
    for r, (s, start) in enumerate(zip(seqs, resp_starts)):
        tokens[r, : len(s)] = s
        att[r, : len(s)] = 1
        lo, hi = start, len(s) - 2  # anchor needs at least one label after it
        if hi < lo:
            continue
        cand = torch.arange(lo, hi + 1)
        pick = cand[torch.randperm(len(cand), generator=gen)[:n_anchors]].sort().values
        anchors[r, : len(pick)] = pick
        valid[r, : len(pick)] = True
    offs = torch.arange(B)
    pos = anchors[:, :, None] + offs  # [b, n, B]
    lengths = att.sum(1)
    label_ok = (pos < lengths[:, None, None]) & (offs > 0) & valid[:, :, None]
    labels = torch.where(label_ok, tokens.gather(1, pos.clamp(max=S - 1).view(b, -1)).view(b, n_anchors, B), -100)
    block_tokens = torch.full((b, n_anchors, B), mask_id, dtype=torch.long)
    block_tokens[:, :, 0] = tokens.gather(1, anchors)
    q = n_anchors * B
    ctx_vis = torch.arange(S)[None, None, :] < anchors.repeat_interleave(B, dim=1)[:, :, None]  # [b, q, S]
    blk = torch.arange(q) // B
    blk_vis = (blk[:, None] == blk[None, :]).expand(b, q, q)
    mask = torch.cat([ctx_vis, blk_vis], dim=2)[:, None]
    return {"tokens": tokens, "att": att, "block_tokens": block_tokens.view(b, q), "block_pos": pos.view(b, q),
            "labels": labels.view(b, q), "mask": mask, "n_anchors": torch.tensor(n_anchors)}


def block_loss(
    logits: torch.Tensor, labels: torch.Tensor, block_size: int, gamma: float
) -> tuple[torch.Tensor, float, int]:
    """Weighted CE over block rows 1..B-1; also the estimated acceptance length (1 + leading correct rows)."""
    b, q, V = logits.shape
    k = torch.arange(q) % block_size
    w = torch.exp(-(k.clamp(min=1) - 1).float() / gamma)[None].expand(b, q)
    ok = labels >= 0
    ce = F.cross_entropy(logits.reshape(-1, V).float(), labels.clamp(min=0).reshape(-1), reduction="none").view(b, q)
    wsum = (w * ok).sum().clamp(min=1e-6)
    loss = (ce * w * ok).sum() / wsum
    with torch.no_grad():
        correct = ((logits.argmax(-1) == labels) & ok).view(b, -1, block_size)[:, :, 1:]
        has = ok.view(b, -1, block_size)[:, :, 1].reshape(-1)
        lead = correct.long().cumprod(-1).sum(-1).reshape(-1)[has]
        tau = 1.0 + lead.float().mean().item() if len(lead) else 1.0
    return loss, tau, int(has.sum())
