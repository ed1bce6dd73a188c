"""Responses for prompts the data gives none for: the target's own (batched, left-padded) generations."""

from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm

from dflash_core.train.data import Example


@torch.no_grad()
def generate_responses(
    model: Any, tok: Any, examples: list[Example], *, batch_size: int, max_new_tokens: int, temperature: float,
    top_p: float, seed: int, eos_ids: list[int], pad_id: int,
) -> None:
    """Fill missing responses with the target's own (batched, left-padded) generations, ending at EOS."""
    todo = [i for i, ex in enumerate(examples) if ex.response is None]
    if not todo:
        return
    todo.sort(key=lambda i: len(examples[i].prompt))
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    bar = tqdm(total=len(todo), desc="generate", unit="prompt", dynamic_ncols=True, mininterval=2)
    for start in range(0, len(todo), batch_size):
        idx = todo[start : start + batch_size]
        width = max(len(examples[i].prompt) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = examples[i].prompt
            ids[r, width - len(p) :] = torch.tensor(p)
            att[r, width - len(p) :] = 1
        kwargs: dict[str, Any] = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        out = model.generate(
            input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=max_new_tokens,
            eos_token_id=eos_ids or None, pad_token_id=pad_id, **kwargs,
        )
        for r, i in enumerate(idx):
            resp = out[r, width:].tolist()
            for j, t in enumerate(resp):
                if t in eos_ids:
                    resp = resp[: j + 1]
                    break
            examples[i].response = resp
        bar.update(len(idx))
    bar.close()
