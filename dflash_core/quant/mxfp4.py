"""gpt-oss's MoE experts kept in MXFP4, as OpenAI's checkpoints ship them (`quant_method: mxfp4`).

Each expert projection is held as the checkpoint holds it: `{proj}_blocks` [experts, out, in / 32, 16] uint8 (two
FP4 e2m1 codes a byte, the even input in the low nibble) and `{proj}_scales` [experts, out, in / 32] uint8 (a
power-of-two scale per 32 inputs, E8M0, biased by 127), beside the projection's bias in the compute dtype: 4.25 bits
a weight instead of 16. Everything else of the model (attention, router, embeddings, head) is full precision in
those checkpoints and stays so.

A forward runs transformers' own gpt-oss expert arithmetic (`GptOssExperts`: its clamped SwiGLU gate, each hit
expert's tokens gathered, weighted by the router and summed back) with each hit expert's weights dequantized by
transformers' own MXFP4 function (`convert_moe_packed_tensors`, the one its dequantizing load runs), so the output
equals transformers' forward of the checkpoint dequantized at load; only the experts a forward routes to are
dequantized, one at a time.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

# inputs per scale and bytes per block of them (two FP4 codes a byte)
MX_BLOCK, MX_BYTES = 32, 16


class Mxfp4Experts(nn.Module):
    """gpt-oss's experts with MXFP4 weights: parameters named as its checkpoints (`gate_up_proj_blocks`,
    `gate_up_proj_scales`, `gate_up_proj_bias`, `down_proj_blocks`, `down_proj_scales`, `down_proj_bias`); the
    gate is `GptOssExperts`' own. Not a `GptOssExperts`: transformers would initialize full-precision experts in it."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = config.num_local_experts, config.hidden_size
        self.intermediate_size = config.intermediate_size
        # transformers 5.17's config has neither field (its experts fix them); OpenAI's config.json sets the limit
        self.alpha = getattr(config, "swiglu_alpha", 1.702)
        self.limit = getattr(config, "swiglu_limit", 7.0)
        self.compute_dtype = dtype
        if self.hidden_size % MX_BLOCK or self.intermediate_size % MX_BLOCK:
            raise ValueError(f"MXFP4 experts need sides that divide by {MX_BLOCK} (hidden {self.hidden_size}, "
                             f"intermediate {self.intermediate_size})")
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size

        def param(*shape: int, kind: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=kind, device=device), requires_grad=False)

        for proj, out, inputs in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            setattr(self, f"{proj}_blocks", param(e, out, inputs // MX_BLOCK, MX_BYTES, kind=torch.uint8))
            setattr(self, f"{proj}_scales", param(e, out, inputs // MX_BLOCK, kind=torch.uint8))
            setattr(self, f"{proj}_bias", param(e, out, kind=dtype))

    def expert_weight(self, proj: str, expert: int) -> torch.Tensor:
        """Expert `expert`'s `proj` weight [in, out] in the compute dtype, as `GptOssExperts` holds it."""
        blocks, scales = getattr(self, f"{proj}_blocks"), getattr(self, f"{proj}_scales")
        weight = convert_moe_packed_tensors(blocks[expert:expert + 1], scales[expert:expert + 1],
                                            dtype=self.compute_dtype)[0]
        return weight.to(blocks.device)  # (transformers' function falls back to the CPU when the device is full)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        """`GptOssExperts.forward`'s arithmetic over the experts `router_indices` hits."""
        out = torch.zeros_like(hidden_states)
        hits = nn.functional.one_hot(router_indices, num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, tokens]
        for expert in hits.sum(dim=(-1, -2)).nonzero()[:, 0].tolist():
            slot, tokens = torch.where(hits[expert])
            gate_up = hidden_states[tokens] @ self.expert_weight("gate_up_proj", expert)
            gated = GptOssExperts._apply_gate(self, gate_up + self.gate_up_proj_bias[expert])
            y = gated @ self.expert_weight("down_proj", expert) + self.down_proj_bias[expert]
            out.index_add_(0, tokens, (y * routing_weights[tokens, slot, None]).to(hidden_states.dtype))
        return out

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, mxfp4"
