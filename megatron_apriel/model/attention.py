"""Packed-sequence (THD) attention for Megatron's local layer spec.

Transformer Engine handles ``PackedSeqParams(qkv_format="thd")`` natively; Megatron's local
``DotProductAttention`` refuses it. This subclass accepts the same packed input, turns
``cu_seqlens`` into a block-diagonal causal mask and runs the local kernel, so the CPU path and
the GPU path consume the same packed batch. RoPE positions restart at each sequence in both
paths: Megatron's attention applies RoPE per segment from ``cu_seqlens`` before calling us.

Context parallelism (``parallel.cp`` > 1), the CPU path's form of what TE's CP attention does on
GPUs: each CP rank holds two chunks of every segment (``parallel.context.cp_positions``); the keys and
values of the whole row are assembled from every rank's by an all-reduce of disjoint scatters
(backward: the same all-reduce of their gradients, each rank keeping its own positions), and the
local queries attend to them under the row's block-causal mask, rows taken at their global
positions. Simple, exact and memory-hungry (the whole row's K and V on every rank): a test path.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_apriel.parallel.context import cp_positions


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where attention is forbidden (other segment or future)."""
    segment = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
    segment[cu_seqlens[1:-1].long()] = 1
    segment = segment.cumsum(0)
    pos = torch.arange(total, device=cu_seqlens.device)
    allowed = (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None])
    return ~allowed[None, None]


class _RowOverCP(torch.autograd.Function):
    """``[t_local, ...]`` at ``where`` -> ``[T, ...]``, the whole row assembled over the CP group."""

    @staticmethod
    def forward(ctx, x, where, total, group):
        row = x.new_zeros((total, *x.shape[1:]))
        row[where] = x
        dist.all_reduce(row, group=group)
        ctx.where, ctx.group = where, group
        return row

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's queries that read these keys
        return grad[ctx.where], None, None, None


class PackedDotProductAttention(DotProductAttention):
    def __init__(self, config, *args, pg_collection=None, **kwargs):
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_size = config.context_parallel_size
        if self.cp_size > 1:  # Megatron's local kernel refuses CP; the CP part is done here, around it
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, *args, pg_collection=pg_collection, **kwargs)
        self.cp_group = cp_group

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            if self.cp_size > 1:
                raise ValueError("context parallelism on the CPU path needs packed rows: set trainer.packing=true.")
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed attention expects qkv_format='thd', got {packed_seq_params.qkv_format!r}.")
        cu = packed_seq_params.cu_seqlens_q
        total = query.shape[0] * self.cp_size
        mask = block_causal_mask(cu, total)  # [1, 1, T, T]
        if self.cp_size > 1:
            where = cp_positions(cu.cpu(), self.cp_size, dist.get_rank(self.cp_group)).to(query.device)
            key = _RowOverCP.apply(key, where, total, self.cp_group)
            value = _RowOverCP.apply(value, where, total, self.cp_group)
            mask = mask[:, :, where]  # the local queries' rows: [1, 1, t_local, T]
        # THD: [t, heads, head_dim]; the local kernel wants [s, b=1, heads, head_dim]
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

