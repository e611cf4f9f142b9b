"""Context parallelism's split of a packed row (pure): which positions each CP rank holds.

Megatron's load-balanced split for causal attention: each segment of the row (one sequence, padded
to a multiple of 2 x cp) is cut into 2cp equal chunks, and CP rank ``r`` holds chunks ``r`` and
``2cp - 1 - r``, so every rank gets as many early (cheap) as late (expensive) queries. TE's
``thd_get_partitioned_indices`` and Megatron's THD RoPE use the same split.
"""

from __future__ import annotations

import torch


def cp_positions(cu_seqlens: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """``[T / cp]`` int64: the row positions CP rank ``cp_rank`` holds, segment by segment: chunks
    ``cp_rank`` and ``2cp - 1 - cp_rank`` of each segment cut into 2cp equal chunks."""
    bounds = cu_seqlens.tolist()
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if (b - a) % (2 * cp):
            raise ValueError(f"a packed segment of {b - a} positions cannot be split into 2 x cp = {2 * cp} chunks: "
                             "pack with align=2*cp.")
        c = (b - a) // (2 * cp)
        parts += [torch.arange(a + cp_rank * c, a + (cp_rank + 1) * c),
                  torch.arange(a + (2 * cp - 1 - cp_rank) * c, a + (2 * cp - cp_rank) * c)]
    return torch.cat(parts)
