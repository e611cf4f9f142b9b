"""One stage's update on the wire, both directions (no vLLM, no Megatron): the plan, the buckets
in plan order, then the checksum table. The sender draws tensors in the plan's order: a direct
bucket goes out from the tensor's own memory (its checksum is taken while it is on the wire; both
only read it); small tensors are packed into one of two buffers, checksummed step by step as they
are copied, and sent when the bucket is full. Up to ``depth`` broadcasts are in flight. The
receiver checksums bucket k while bucket k+1 arrives and compares with the table at the end."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_apriel.records.weights import BucketLayout, StagePlan
from megatron_apriel.weight_sync import buckets as B
from megatron_apriel.weight_sync.device_staging import DeviceStaging, host_buffer
from megatron_apriel.weight_sync.transport import StageGroup, recv_plan, send_plan

BucketHook = Callable[[int, BucketLayout, torch.Tensor], Optional[torch.Tensor]]
"""(stage, bucket, the bucket's bytes after its checksum was taken) -> None, or bytes to send
instead (tests send a corrupted copy; a direct bucket's bytes are the trainer's own tensor)."""

SEND_DEPTH = 2
"""Broadcasts in flight per stage, on either side. gloo over loopback here: 64 MiB buckets reach
the single-broadcast speed at depth 2 (one in flight each side leaves the link idle between)."""


class DoubleBuffer:
    """Two reusable packing buffers, grown on demand."""

    def __init__(self, device: torch.device):
        self.device, self.buffers = device, [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]

    def wire(self, layout: BucketLayout, slot: int) -> torch.Tensor:
        if self.buffers[slot].numel() < layout.nbytes:
            self.buffers[slot] = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        return self.buffers[slot][: layout.nbytes]


class _InFlight:
    """Broadcasts on the wire, oldest first, each holding what must stay alive until it is done.
    The first wire error is kept in ``failure``; nothing more is sent after it."""

    def __init__(self, group: StageGroup, depth: int):
        self.group, self.depth = group, depth
        self.works: deque = deque()  # (sequence number, work, kept alive)
        self.sent = 0
        self.failure: Optional[str] = None

    def _guard(self, call: Callable[[], object]) -> None:
        if self.failure is not None:
            return
        try:
            call()
        except RuntimeError as err:  # gloo and NCCL report a closed or reset peer as RuntimeError subclasses
            self.failure = f"{type(err).__name__}: {err}"
            self.works.clear()

    def wait_through(self, seq: int) -> None:
        """Until broadcast number ``seq`` (and every earlier one) is done."""
        while self.works and self.works[0][0] <= seq and self.failure is None:
            self._guard(self.works.popleft()[1].wait)

    def launch(self, data: torch.Tensor, keep: object = None) -> int:
        self.wait_through(self.sent - self.depth)
        seq, self.sent = self.sent, self.sent + 1
        self._guard(lambda: self.works.append((seq, self.group.broadcast(data, async_op=True), keep)))
        return seq

    def drain(self) -> None:
        self.wait_through(self.sent)


class _StageSender:
    def __init__(self, group: StageGroup, plan: StagePlan, buffers: DoubleBuffer, on_bucket: Optional[BucketHook],
                 depth: int, checksums: bool):
        self.plan, self.buffers, self.on_bucket = plan, buffers, on_bucket
        self.algo = plan.checksum if checksums else None
        self.wire = _InFlight(group, depth)
        self.where = {s.name: b for b in plan.buckets for s in b.tensors}
        self.sums: list = [None] * len(plan.buckets)
        self.next_index = 0
        self.packer: Optional[B.BucketPacker] = None
        self.packed = 0  # packed buckets opened so far (their buffer slot alternates)
        self.slot_seq = [-1, -1]  # each buffer's last broadcast

    def run(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Optional[str]:
        self.wire._guard(lambda: send_plan(self.wire.group, self.plan))
        for name, tensor in tensors:
            layout = self.where.get(name)
            if layout is None:
                raise RuntimeError(f"the stage produced {name!r}, which its plan does not hold; metadata and data "
                                   "disagree.")
            if self.wire.failure is None:  # after a failure every tensor is still drawn (TP peers stay in step)
                self._direct(layout, name, tensor) if layout.direct else self._pack(layout, name, tensor)
        if self.wire.failure is None:
            if self.next_index != len(self.plan.buckets):
                raise RuntimeError(f"the stage produced the tensors of {self.next_index} of its "
                                   f"{len(self.plan.buckets)} buckets; metadata and data disagree.")
            if self.plan.buckets:
                table = B.checksum_table(self.sums if self.algo else [0] * len(self.sums)).to(self.wire.group.device)
                self.wire.launch(table, table)
        self.wire.drain()
        return self.wire.failure

    def _next(self, layout: BucketLayout) -> None:
        if layout.index != self.next_index:
            raise RuntimeError(f"bucket {layout.index} is complete before bucket {self.next_index}; the stage's "
                               "tensors come in another order than its plan.")
        self.next_index += 1

    def _send(self, layout: BucketLayout, data: torch.Tensor) -> int:
        replacement = self.on_bucket(self.plan.stage, layout, data) if self.on_bucket is not None else None
        sent = data if replacement is None else replacement
        return self.wire.launch(sent, (data, sent))

    def _direct(self, layout: BucketLayout, name: str, tensor: torch.Tensor) -> None:
        self._next(layout)
        data = B.direct_bytes_of(layout, name, tensor)
        if self.algo is None:
            self._send(layout, data)
        elif self.on_bucket is not None:  # the hook sees the bytes after their checksum, as for packed buckets
            self.sums[layout.index] = _sum(data, self.algo)
            self._send(layout, data)
        else:
            self._send(layout, data)
            self.sums[layout.index] = _sum(data, self.algo)  # while the same bytes are on the wire

    def _pack(self, layout: BucketLayout, name: str, tensor: torch.Tensor) -> None:
        if self.packer is None:
            slot = self.packed % 2
            self.wire.wait_through(self.slot_seq[slot])  # that buffer's last broadcast is done
            self.packer = B.BucketPacker(layout, self.buffers.wire(layout, slot), self.algo)
            self.packed += 1
        elif self.packer.layout is not layout:
            raise RuntimeError(f"{name!r} belongs to bucket {layout.index} while bucket {self.packer.layout.index} "
                               "is still filling; the stage's tensors come in another order than its plan.")
        self.packer.add(name, tensor)
        if self.packer.full:
            self._next(layout)
            self.sums[layout.index] = self.packer.finish()
            self.slot_seq[(self.packed - 1) % 2] = self._send(layout, self.packer.wire)
            self.packer = None


def _sum(data: torch.Tensor, algo: str):
    """A bucket's checksum: an int on host, a 0-dim tensor on a device (sum64; no host round trip)."""
    return B.checksum_on_device(data) if data.device.type != "cpu" and algo == "sum64" else B.checksum(data, algo)


def send_stage(group: StageGroup, plan: StagePlan, tensors: Iterator[tuple[str, torch.Tensor]],
               buffers: DoubleBuffer, on_bucket: Optional[BucketHook] = None, depth: int = SEND_DEPTH,
               checksums: bool = True) -> Optional[str]:
    """Send one stage's update. Returns None, or why the wire failed (a receiver died mid-update):
    the stage's tensors are then still all drawn, unsent, so the ranks that produce them through
    collectives (TP gathers) stay in step, and the caller can reconnect and send again.
    ``checksums=False`` (zeros in the table) exists only for the benchmark's baseline."""
    return _StageSender(group, plan, buffers, on_bucket, depth, checksums).run(tensors)


@dataclass
class StageInbox:
    plan: StagePlan
    wires: list[torch.Tensor] = field(default_factory=list)
    """Each bucket's bytes, staged in host memory (pinned when they came from a GPU)."""
    bad_buckets: list[str] = field(default_factory=list)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for layout, wire in zip(self.plan.buckets, self.wires):
            yield from B.unpack(layout, wire)


def receive_stage(group: StageGroup, checker: ThreadPoolExecutor, pool: Optional[dict] = None,
                  checksums: bool = True) -> StageInbox:
    """Receive one stage's update into host staging; ``pool`` (bucket index -> host buffer) is
    reused across updates. Every bucket is checksummed as it lands (host: on ``checker``'s
    thread, while the next arrives; GPU: on the device) and compared with the stage's table.
    ``checksums=False`` trusts the bytes: only for the benchmark's baseline."""
    inbox = StageInbox(plan=recv_plan(group))
    pool = {} if pool is None else pool
    on_gpu = group.device.type == "cuda"
    staging = DeviceStaging(group.device, pool) if on_gpu else None
    sums, posted = [], deque()  # host: receives posted ahead, so the next bucket streams in at once

    def landed(wire: torch.Tensor, work) -> None:
        work.wait()
        if checksums:
            sums.append(checker.submit(B.checksum, wire, inbox.plan.checksum))

    for layout in inbox.plan.buckets:
        if on_gpu:  # NCCL queues on its stream: the host never waits here
            wire = staging.buffer(layout)
            group.broadcast(wire)
            if checksums:
                sums.append(B.checksum_on_device(wire))
            inbox.wires.append(staging.stage(layout, wire))
            continue
        if len(posted) == SEND_DEPTH:
            landed(*posted.popleft())
        wire = host_buffer(pool, layout, pin=False)
        posted.append((wire, group.broadcast(wire, async_op=True)))
        inbox.wires.append(wire)
    while posted:
        landed(*posted.popleft())
    table = torch.empty(len(inbox.plan.buckets), dtype=torch.int64, device=group.device)
    if inbox.plan.buckets:
        group.broadcast(table)
    if staging is not None:
        staging.finish()
    if not checksums:
        return inbox
    actual = B.table_values(torch.stack(sums)) if on_gpu and sums else [f.result() for f in sums]
    for layout, got, sent in zip(inbox.plan.buckets, actual, B.table_values(table)):
        if got != sent:
            kind = "direct" if layout.direct else "packed"
            inbox.bad_buckets.append(f"stage {inbox.plan.stage} {kind} bucket {layout.index} "
                                     f"(checksum {got:#x} != sent {sent:#x})")
    return inbox
