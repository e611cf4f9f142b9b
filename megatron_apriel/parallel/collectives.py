"""The few world-wide collectives the trainer needs outside Megatron's own."""

from __future__ import annotations

from typing import Literal, Mapping, Optional

import torch
import torch.distributed as dist

Reduction = Literal["sum", "min", "max"]
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def _device() -> torch.device:
    """Where the default group's collectives run: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one (e.g. a stop signal)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def sum_over_world(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor summed over every rank (CPU tensors in, CPU tensors out)."""
    names = sorted(tensors)
    flat = torch.cat([tensors[n].flatten().float() for n in names]).to(_device())
    dist.all_reduce(flat)
    out, start = {}, 0
    for n in names:
        size = tensors[n].numel()
        out[n] = flat[start:start + size].cpu().reshape(tensors[n].shape)
        start += size
    return out


def broadcast_object(obj, src: int = 0):
    """``obj`` from rank ``src`` on every rank (picklable; small control data, not tensors)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_device())
    return box[0]


def from_the_one_rank(obj):
    """On every rank, the object that exactly one rank passes (the others pass None): for what only
    one rank knows, wherever it sits (e.g. the logging rank, the last pipeline stage's)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    given = [o for o in everyone if o is not None]
    if len(given) != 1:
        raise RuntimeError(f"from_the_one_rank: {len(given)} ranks passed an object, expected exactly one.")
    return given[0]


def barrier() -> None:
    dist.barrier()


def world_rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``t`` over ``group`` (in place; returned for convenience)."""
    dist.all_reduce(t, group=group)
    return t


def all_gather_cat(t: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Every rank's ``t`` of ``group``, concatenated along ``dim`` in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def reduce_metrics(parts: list[dict[str, torch.Tensor]], reductions: Mapping[str, Reduction], group: Optional = None,
                   default: Reduction = "sum") -> dict[str, float]:
    """Scalar metrics combined over ``parts`` (e.g. micro-batches), then over ``group`` (None: this
    rank alone): each key by its declared reduction in ``reductions``, ``default`` for the others."""
    out: dict[str, float] = {}
    for kind in _OPS:
        names = sorted(k for k in parts[0] if reductions.get(k, default) == kind)
        if not names:
            continue
        stacked = torch.stack([torch.stack([m[k].float() for k in names]) for m in parts])
        local = {"sum": lambda: stacked.sum(0), "min": lambda: stacked.min(0).values,
                 "max": lambda: stacked.max(0).values}[kind]()
        if group is not None:
            dist.all_reduce(local, op=_OPS[kind], group=group)
        out.update({k: float(v) for k, v in zip(names, local.tolist())})
    return out
