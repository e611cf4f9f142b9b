"""Pure tensor transforms between Hugging Face and canonical Megatron layouts, each with its inverse.

Every ``merge_*`` has a ``split_*`` with ``split(merge(x)) == x`` bit for bit: they only
reshape, slice and concatenate, never do arithmetic. Shapes use ``d`` = head_dim, ``h`` = the
input width (hidden size), ``nq`` / ``nkv`` = query / key-value heads; a trailing ``...`` means
"whatever follows" (``[h]`` for weights, nothing for biases and qk-norm).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a transform runs: the dry run reads shapes only
    import torch

RowPiece = tuple[int, int, int]
"""``(source, first_row, end_row)``: rows ``[first_row, end_row)`` of the ``source``-th input.
A merge equals the concatenation (dim 0) of its row pieces, in order, so a writer can store the
merged tensor piece by piece straight from the inputs without building it."""


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """HF ``q [nq*d, ...]``, ``k [nkv*d, ...]``, ``v [nkv*d, ...]`` -> Megatron ``[(nq+2*nkv)*d, ...]``.

    Megatron groups the rows per KV head: for each group g, the ``nq/nkv`` query heads of the
    group, then k head g, then v head g (``d`` rows each). Works for head_dim != hidden/heads.
    """
    rest = q.shape[1:]
    assert k.shape == v.shape and k.shape[1:] == rest, (q.shape, k.shape, v.shape)
    assert k.shape[0] == num_kv_heads * head_dim and q.shape[0] % k.shape[0] == 0, (q.shape, k.shape)
    qg = q.reshape(num_kv_heads, -1, *rest)
    kg = k.reshape(num_kv_heads, head_dim, *rest)
    vg = v.reshape(num_kv_heads, head_dim, *rest)
    import torch

    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def qkv_row_pieces(q_rows: int, num_kv_heads: int, head_dim: int) -> list[RowPiece]:
    """:func:`merge_qkv` as row pieces of (q, k, v): per group g, its query rows, k head g, v head g."""
    assert q_rows % num_kv_heads == 0, (q_rows, num_kv_heads)
    qg, d = q_rows // num_kv_heads, head_dim
    return [p for g in range(num_kv_heads) for p in ((0, g * qg, (g + 1) * qg), (1, g * d, (g + 1) * d),
                                                     (2, g * d, (g + 1) * d))]


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`merge_qkv`: ``[(nq+2*nkv)*d, ...]`` -> contiguous ``(q, k, v)``."""
    rest = qkv.shape[1:]
    q_rows = num_heads // num_kv_heads * head_dim
    assert qkv.shape[0] == (num_heads + 2 * num_kv_heads) * head_dim, (qkv.shape, num_heads, num_kv_heads, head_dim)
    grouped = qkv.reshape(num_kv_heads, q_rows + 2 * head_dim, *rest)
    q, k, v = grouped.split([q_rows, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate [f, h]``, ``up [f, h]`` -> Megatron SwiGLU ``linear_fc1 [2f, h]`` = [gate; up]."""
    assert gate.shape == up.shape, (gate.shape, up.shape)
    import torch

    return torch.cat([gate, up], dim=0)


def gate_up_row_pieces(ffn_rows: int) -> list[RowPiece]:
    """:func:`merge_gate_up` as row pieces of (gate, up)."""
    return [(0, 0, ffn_rows), (1, 0, ffn_rows)]


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`merge_gate_up`: ``[2f, h]`` -> contiguous ``(gate [f, h], up [f, h])``."""
    assert fc1.shape[0] % 2 == 0, fc1.shape
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """``[V, h]`` -> ``[padded_rows, h]`` with zero rows appended (Megatron pads for TP)."""
    assert padded_rows >= weight.shape[0], (weight.shape, padded_rows)
    if padded_rows == weight.shape[0]:
        return weight
    out = weight.new_zeros((padded_rows, *weight.shape[1:]))
    out[: weight.shape[0]] = weight
    return out


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Inverse of :func:`pad_vocab`: keep the first ``vocab_size`` rows (contiguous)."""
    assert weight.shape[0] >= vocab_size, (weight.shape, vocab_size)
    return weight[:vocab_size].contiguous()
