"""A receiver's host staging, and the GPU-only half of it (CUDA streams and pinned memory; run only
when the weight-sync backend is NCCL, ``group.device.type == "cuda"``).

Receive: buckets land in two device buffers in turn; each is checksummed on the device, then
copied to pinned host staging on a side stream while the next one arrives (``DeviceStaging``).
Apply: staged buckets go back up one ahead of the model's ``load_weights`` (``device_tensors``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_apriel.records.weights import BucketLayout
from megatron_apriel.weight_sync import buckets as B


def host_buffer(pool: dict, layout: BucketLayout, pin: bool) -> torch.Tensor:
    """Reused across updates: fresh multi-MB buffers cost page faults (and, pinned, a slow
    registration) that take longer than the transfer itself."""
    if layout.index not in pool or pool[layout.index].numel() < layout.nbytes:
        pool[layout.index] = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
    return pool[layout.index][: layout.nbytes]


class DeviceStaging:
    """GPU receiver: buckets arrive in two device buffers in turn; each is checksummed on the
    device, then copied to pinned host staging on a side stream while the next bucket arrives.
    Device memory: two buckets, not the whole update."""

    def __init__(self, device: torch.device, pool: dict):
        self.device, self.pool = device, pool
        self.stream = torch.cuda.Stream(device)
        self.ring = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]
        self.copied: list = [None, None]  # each ring buffer's last copy to the host

    def buffer(self, layout: BucketLayout) -> torch.Tensor:
        slot = layout.index % 2
        if self.copied[slot] is not None:  # the broadcast into it is queued after its copy-out
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        if self.ring[slot].numel() < layout.nbytes:
            self.ring[slot] = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        return self.ring[slot][: layout.nbytes]

    def stage(self, layout: BucketLayout, wire: torch.Tensor) -> torch.Tensor:
        host = host_buffer(self.pool, layout, pin=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(wire, non_blocking=True)
            self.copied[layout.index % 2] = torch.cuda.Event()
            self.copied[layout.index % 2].record(self.stream)
        return host

    def finish(self) -> None:
        self.stream.synchronize()


def device_tensors(inboxes: list, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """A GPU receiver's apply (``inboxes``: the stages' ``stream.StageInbox``): every staged
    bucket's tensors on ``device``, bucket k+1 copied up on a side stream while the model loads
    bucket k. Each bucket gets a fresh device buffer (the caching allocator reuses memory), since
    vLLM's layerwise reload may hold tensors until their layer is complete."""
    items = [(layout, host) for inbox in inboxes for layout, host in zip(inbox.plan.buckets, inbox.wires)]
    stream = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)

    def upload(layout: BucketLayout, host: torch.Tensor):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)
            dev.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        dev.record_stream(current)  # used on the loading stream: not reused before that work is done
        return layout, dev, done

    ahead = upload(*items[0]) if items else None
    for k in range(len(items)):
        layout, dev, done = ahead
        ahead = upload(*items[k + 1]) if k + 1 < len(items) else None
        current.wait_event(done)
        yield from B.unpack(layout, dev)
