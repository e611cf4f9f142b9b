"""The few world-wide collectives the trainer needs outside Megatron's own."""

from __future__ import annotations

import torch
import torch.distributed as dist


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one (e.g. a stop signal)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    dist.barrier()


def world_rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()
