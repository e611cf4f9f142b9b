"""Packed-sequence (THD) attention for Megatron's local layer spec.

Transformer Engine handles ``PackedSeqParams(qkv_format="thd")`` natively; Megatron's local
``DotProductAttention`` refuses it. This subclass accepts the same packed input, turns
``cu_seqlens`` into a block-diagonal causal mask and runs the local kernel, so the CPU path and
the GPU path consume the same packed batch. RoPE positions restart at each sequence in both
paths: Megatron's attention applies RoPE per segment from ``cu_seqlens`` before calling us.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where attention is forbidden (other segment or future)."""
    segment = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
    segment[cu_seqlens[1:-1].long()] = 1
    segment = segment.cumsum(0)
    pos = torch.arange(total, device=cu_seqlens.device)
    allowed = (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None])
    return ~allowed[None, None]


class PackedDotProductAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed attention expects qkv_format='thd', got {packed_seq_params.qkv_format!r}.")
        # THD: [t, heads, head_dim]; the local kernel wants [s, b=1, heads, head_dim]
        mask = block_causal_mask(packed_seq_params.cu_seqlens_q, query.shape[0])
        out = super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, attn_mask_type,
                              attention_bias)
        return out.reshape(out.shape[0], -1)  # [t, heads*head_dim]; attention.py restores the b=1 dim


def localize(spec) -> None:
    """Give one of Megatron's local layer specs (in place) the packed-capable core attention and
    norms that also run under sequence parallelism (``model/norm.py``)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_apriel.model.norm import LocalRMSNorm

    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    attention.core_attention = ModuleSpec(module=PackedDotProductAttention)
    layer.input_layernorm = layer.pre_mlp_layernorm = LocalRMSNorm
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) is not IdentityOp:
            setattr(attention, name, LocalRMSNorm)

