"""Megatron DDP's parameter/gradient buffers and the distributed optimizer's state, to the byte.

What our trainer builds (``model/wrap.py``): ``DistributedDataParallel`` with
``use_distributed_optimizer=True``, ``overlap_grad_reduce=False`` (so one bucket per buffer,
except that a tied embedding gets its own bucket when pp > 1) and fp32 gradient reduction.
Megatron then lays the stage's parameters out in reverse order in one flat buffer per parameter
dtype (the local spec's norms stay fp32 in a bf16 model, so it has two), starts each parameter at
a multiple of 64 elements and pads each bucket to a multiple of lcm(dp, 128); the model's weights
become views into a param buffer of that size and the gradients live in a grad buffer of that
size (``megatron/core/distributed/param_and_grad_buffer.py``).

A mixture of experts' expert weights live in buffers of their own, sharded over the expert
data-parallel group (``tp * dp / ep`` ranks) instead of the data-parallel one.

The distributed optimizer gives data-parallel rank ``r`` the ``r``-th equal slice of every bucket
and keeps, for the parameter elements inside its slice (padding excluded): an fp32 master copy
when the weights are not fp32 (fp32 weights are updated in place), and Adam's ``exp_avg`` and
``exp_avg_sq`` in fp32 (``megatron/core/optimizer/distrib_optimizer.py``). torch's Adam (the one
Megatron uses without Transformer Engine / Apex) also keeps a 4-byte ``step`` tensor per
parameter shard; TE's FusedAdam keeps the step per group instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_apriel.model.arch import ModelArch
from megatron_apriel.plan.params import StageShape, element_bytes, is_expert, is_shared_embedding, stage_params

PARAM_ALIGN = 64
FP32 = 4


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Bucket:
    start: int
    end: int
    params: tuple[tuple[str, int, int], ...]
    """(name, start, end) of each parameter inside the buffer."""


def layout(params: list[tuple[str, int]], dp: int, own_bucket: set[str] = frozenset()) -> list[Bucket]:
    """Megatron's buffer layout for these ``(name, numel)`` (registration order), DP size ``dp``."""
    divisor = math.lcm(dp, 128)
    buckets, current, bucket_start, cursor = [], [], 0, 0

    def close(end: int) -> int:
        nonlocal current, bucket_start
        padded = _pad(end, divisor)
        buckets.append(Bucket(bucket_start, padded, tuple(current)))
        current, bucket_start = [], padded
        return padded

    for name, numel in reversed(params):
        cursor = _pad(cursor, PARAM_ALIGN)
        if name in own_bucket and current:
            cursor = close(cursor)
        current.append((name, cursor, cursor + numel))
        cursor += numel
        if name in own_bucket:
            cursor = close(cursor)
    if current:
        close(cursor)
    return buckets


def shard_elements(buckets: list[Bucket], dp: int, dp_rank: int) -> list[int]:
    """Per parameter overlapping rank ``dp_rank``'s slice: how many of its elements lie there."""
    out = []
    for b in buckets:
        size = (b.end - b.start) // dp
        lo, hi = b.start + dp_rank * size, b.start + (dp_rank + 1) * size
        out += [min(end, hi) - max(start, lo) for _, start, end in b.params if min(end, hi) > max(start, lo)]
    return out


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds for weights, gradients and optimizer state."""

    weights: int
    grads: int
    master: int
    adam: int
    step_counters: int

    @property
    def optimizer(self) -> int:
        return self.master + self.adam + self.step_counters

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def _buffers(params: list[tuple[str, int]], where: StageShape, own: set[str], dp: int, dp_rank: int,
             param_bytes: int, grad_bytes: int, step_counter_bytes: int) -> StateBytes:
    """One DDP buffer set (one buffer per dtype, in order of first appearance) sharded over ``dp``."""
    by_dtype: dict[int, list[tuple[str, int]]] = {}
    for name, numel in params:
        by_dtype.setdefault(element_bytes(name, where, param_bytes), []).append((name, numel))
    weights = grads = master = adam = counters = 0
    for nbytes, group in by_dtype.items():
        buckets = layout(group, dp, own)
        shards = shard_elements(buckets, dp, dp_rank)
        weights += buckets[-1].end * nbytes
        grads += buckets[-1].end * grad_bytes
        master += 0 if nbytes == FP32 else FP32 * sum(shards)
        adam += 2 * FP32 * sum(shards)
        counters += step_counter_bytes * len(shards)
    return StateBytes(weights=weights, grads=grads, master=master, adam=adam, step_counters=counters)


def _add(a: StateBytes, b: StateBytes) -> StateBytes:
    return StateBytes(*(x + y for x, y in zip(
        (a.weights, a.grads, a.master, a.adam, a.step_counters),
        (b.weights, b.grads, b.master, b.adam, b.step_counters))))


def _parts(arch: ModelArch, where: StageShape) -> tuple[list, set, list]:
    params = stage_params(arch, where)
    own = {name for name, _ in params if is_shared_embedding(arch, where, name)}
    return [p for p in params if not is_expert(p[0])], own, [p for p in params if is_expert(p[0])]


def state_bytes(arch: ModelArch, where: StageShape, dp: int, dp_rank: int, param_bytes: int,
                grad_bytes: int = FP32, step_counter_bytes: int = FP32, expert_dp_rank: int = 0) -> StateBytes:
    """What one (tp rank, stage, dp rank) allocates for its parameters with the distributed
    optimizer; a MoE stage's experts are sharded over ``tp * dp / ep`` ranks (this rank being
    ``expert_dp_rank`` of them)."""
    dense, own, experts = _parts(arch, where)
    sizes = (param_bytes, grad_bytes, step_counter_bytes)
    out = _buffers(dense, where, own, dp, dp_rank, *sizes)
    if experts:
        out = _add(out, _buffers(experts, where, set(), where.tp * dp // where.ep, expert_dp_rank, *sizes))
    return out


def worst_rank_state(arch: ModelArch, where: StageShape, dp: int, param_bytes: int, grad_bytes: int = FP32,
                     step_counter_bytes: int = FP32) -> StateBytes:
    """The rank with the most state: the data-parallel rank with the most dense optimizer state
    (shards differ by the padding) and, for a MoE stage, the expert-DP rank with the most expert
    state (taken independently: exact per part, an upper bound by a few padding bytes overall)."""
    dense, own, experts = _parts(arch, where)
    sizes = (param_bytes, grad_bytes, step_counter_bytes)
    out = max((_buffers(dense, where, own, dp, r, *sizes) for r in range(dp)), key=lambda s: s.total)
    if experts:
        expert_dp = where.tp * dp // where.ep
        out = _add(out, max((_buffers(experts, where, set(), expert_dp, r, *sizes) for r in range(expert_dp)),
                            key=lambda s: s.total))
    return out
