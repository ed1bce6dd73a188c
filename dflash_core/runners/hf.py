"""The `hf` target runner: any transformers causal LM, one request per forward, a `DynamicCache` per request."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from dflash_core.runners.base import TargetOutput, TargetRow, TargetRunner


class HFTarget(TargetRunner):
    """Batch-1 forward of a transformers `AutoModelForCausalLM` with a per-request `DynamicCache`.

    The feature of target layer i is `output_hidden_states[i + 1]` (for the last layer transformers returns it
    after the final norm), concatenated over `layer_ids` on the feature axis.
    """

    backend = "hf"
    max_slots = None  # a DynamicCache per request: no fixed rows
    max_len = None

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None) -> None:
        self.model = model.eval()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = cfg
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_position_embeddings = int(getattr(cfg, "max_position_embeddings", 4096))
        self.layer_ids = list(layer_ids or [])
        # transformers 5.x renamed `past_key_values` to `cache`; 4.57 only knows the old name.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    @property
    def pads_rows(self) -> bool:
        return False  # one request per forward: each row costs its own tokens

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def new_cache(
        self, slot: int = 0, blocks: list[int] | None = None, cached: int = 0, state: Any = None
    ) -> DynamicCache:
        """A fresh cache (the slot does not matter: each request has its own; not paged, so no blocks and no
        cached prefix)."""
        if blocks is not None or cached or state is not None:
            raise ValueError("the hf backend's caches are not paged")
        return DynamicCache()

    def crop(self, cache: DynamicCache, length: int) -> None:
        """Roll the cache back to `length` positions (negative crop works on transformers 4.57 and 5.x).

        Layer by layer: a forward that failed halfway appended to the first layers only.
        """
        layers = getattr(cache, "layers", None)
        if layers is None:  # an older cache layout: one length for all layers
            remove = int(cache.get_seq_length()) - length
            if remove > 0:
                cache.crop(-remove)
            return
        for layer in layers:
            remove = int(layer.get_seq_length()) - length
            if remove > 0:
                layer.crop(-remove)

    @torch.inference_mode()
    def forward(
        self, token_ids: list[int], start: int, cache: DynamicCache, features: bool, last_only: bool = False
    ) -> TargetOutput:
        """Run tokens at positions start.. with the cache; logits for every row (or the last only)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(token_ids), device=self.device)[None]
        want_hidden = features and bool(self.layer_ids)
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            use_cache=True,
            output_hidden_states=want_hidden,
            logits_to_keep=1 if last_only else 0,
            **{self._cache_kw: cache},
        )
        feats = None
        if want_hidden:
            feats = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        return TargetOutput(logits=out.logits[0].float(), features=feats)

    def forward_batch(
        self, rows: Sequence[TargetRow | tuple[list[int], int, Any]], features: bool, last_only: bool = False
    ) -> list[TargetOutput]:
        """One forward per row (transformers caches are per request)."""
        return [self.forward(tokens, start, cache, features, last_only) for tokens, start, cache in rows]
