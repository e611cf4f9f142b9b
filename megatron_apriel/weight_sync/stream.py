"""One stage's update on the wire, both directions (no vLLM, no Megatron): the plan, then each
bucket sealed with its checksum. The sender packs bucket k+1 while bucket k is broadcast (async
op, two buffers); the receiver checksums bucket k while bucket k+1 arrives (a helper thread)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_apriel.weight_sync import buckets as B
from megatron_apriel.weight_sync.protocol import StagePlan
from megatron_apriel.weight_sync.transport import StageGroup, recv_plan, send_plan

BucketHook = Callable[[int, int, torch.Tensor], None]
"""(stage, bucket index, sealed wire buffer) -> None, called just before the broadcast (tests)."""


class DoubleBuffer:
    """Two reusable wire buffers, grown on demand."""

    def __init__(self, device: torch.device):
        self.device, self.buffers = device, [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]

    def wire(self, layout, slot: int) -> torch.Tensor:
        need = layout.nbytes + B.TRAILER
        if self.buffers[slot].numel() < need:
            self.buffers[slot] = torch.empty(need, dtype=torch.uint8, device=self.device)
        return self.buffers[slot][:need]


def send_stage(group: StageGroup, plan: StagePlan, tensors: Iterator[tuple[str, torch.Tensor]],
               buffers: DoubleBuffer, on_bucket: Optional[BucketHook] = None) -> Optional[str]:
    """Send one stage's update. Returns None, or why the wire failed (a receiver died mid-update):
    the stage's tensors are then still all drawn, unsent, so the ranks that produce them through
    collectives (TP gathers) stay in step, and the caller can reconnect and send again."""
    failure, inflight = None, None
    try:
        send_plan(group, plan)
    except RuntimeError as err:  # gloo and NCCL report a closed or reset peer as RuntimeError subclasses
        failure = f"{type(err).__name__}: {err}"
    for layout in plan.buckets:
        if failure is not None:
            for _ in layout.tensors:
                next(tensors)
            continue
        wire = buffers.wire(layout, layout.index % 2)  # the other buffer may still be on the wire
        B.pack_sealed(layout, (next(tensors) for _ in layout.tensors), wire, plan.checksum)
        if on_bucket is not None:
            on_bucket(plan.stage, layout.index, wire)
        try:
            if inflight is not None:
                inflight.wait()
            inflight = group.broadcast(wire, async_op=True)
        except RuntimeError as err:
            failure, inflight = f"{type(err).__name__}: {err}", None
    try:
        if inflight is not None:
            inflight.wait()
    except RuntimeError as err:
        failure = f"{type(err).__name__}: {err}"
    if next(tensors, None) is not None:
        raise RuntimeError("the stage produced more tensors than its plan holds; metadata and data disagree.")
    return failure


@dataclass
class StageInbox:
    plan: StagePlan
    wires: list[torch.Tensor] = field(default_factory=list)
    """Verified payloads, staged in host memory."""
    bad_buckets: list[str] = field(default_factory=list)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for layout, wire in zip(self.plan.buckets, self.wires):
            yield from B.unpack(layout, wire)


def receive_stage(group: StageGroup, checker: ThreadPoolExecutor, pool: Optional[dict] = None) -> StageInbox:
    """Receive one stage's update. ``pool`` (bucket index -> buffer) is reused across updates:
    fresh multi-MB buffers cost page faults that take longer than the transfer itself."""
    inbox = StageInbox(plan=recv_plan(group))
    pool = {} if pool is None else pool
    checks = []
    for layout in inbox.plan.buckets:
        need = layout.nbytes + B.TRAILER
        if layout.index not in pool or pool[layout.index].numel() < need:
            pool[layout.index] = B.new_wire_buffer(layout, group.device)
        wire = pool[layout.index][:need]
        group.broadcast(wire)
        inbox.wires.append(wire)
        checks.append(checker.submit(B.verify, wire, inbox.plan.checksum))
    for layout, check in zip(inbox.plan.buckets, checks):
        ok, expected, actual = check.result()
        if not ok:
            inbox.bad_buckets.append(f"stage {inbox.plan.stage} bucket {layout.index} "
                                     f"(checksum {actual:#x} != sent {expected:#x})")
    inbox.wires = [w.cpu() for w in inbox.wires]  # device buffers were verified in place; stage on host
    return inbox
