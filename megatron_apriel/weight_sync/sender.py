"""Trainer side: push this step's weights to every vLLM server without draining generation.

Call on every trainer rank (never imports vLLM)::

    sender = WeightSender(WeightSyncConfig(servers=[...]), model, ctx, vocab_size, to_hf)
    sender.connect()                      # once: join the per-stage groups
    report = sender.push(version=step)    # after each optimizer step (or every k steps)

Roles: each pipeline stage's sender is its (tp_rank 0, dp_rank 0) rank; the other TP ranks of
that replica only take part in the TP gathers; other DP replicas do nothing but wait for the
report. Global rank 0 (stage 0's sender) is also the coordinator that drives the HTTP routes.

One update, as seen by a server: ``/start_weight_update`` (its receiving threads start; decoding
goes on) -> every stage broadcasts its plan and checksummed buckets on its own group, gathering
and converting bucket k+1 while bucket k is on the wire (async broadcast, two buffers) ->
``/pause?mode=keep`` -> ``/update_weights`` (verify everything, then load) ->
``/finish_weight_update`` (new version label) -> ``/resume``. Requests in flight keep their KV
cache and continue under the new weights; their outputs carry both version labels.

Deadlock freedom with PP > 1: stage groups are independent and the receiver drains them
concurrently, so a stage's broadcast never waits for another stage. Between ``push``'s start and
the final report broadcast, a rank runs only its own stage's TP gathers and broadcast; the only
cross-stage collective (the report) comes after every stage finished sending.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_apriel.parallel.groups import ParallelContext
from megatron_apriel.weight_sync import buckets as B
from megatron_apriel.weight_sync.control import WeightSyncControl
from megatron_apriel.weight_sync.protocol import Endpoint, StagePlan, SyncReport, TransferInit, UpdateRequest
from megatron_apriel.weight_sync.source import StageWeights, ToHF
from megatron_apriel.weight_sync.stream import BucketHook, DoubleBuffer, send_stage
from megatron_apriel.weight_sync.transport import StageGroup, join_stage_group



@dataclass
class WeightSyncConfig:
    servers: list[str] = field(default_factory=list)
    """Base URLs of the vLLM servers (``apriel-serve``), e.g. ``http://node7:8000``."""
    bucket_bytes: int = B.DEFAULT_BUCKET_BYTES
    """Bucket payload size; two buckets per stage sender are alive at once."""
    backend: str = "auto"
    """auto (nccl with CUDA, gloo without), nccl or gloo. Must match the servers' engine."""
    advertise_host: Optional[str] = None
    """Address the servers reach this rank at; null: this host's name."""
    base_port: int = 29700
    """Stage s listens on base_port + s (on its sender's host)."""
    timeout_s: float = 600.0
    checksum: str = "sum64"
    """Per-bucket checksum: sum64 (cheap, any device) or crc32 (stronger, CPU only)."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"weight_sync.backend must be auto, nccl or gloo, got {self.backend!r}.")
        if self.checksum not in ("sum64", "crc32"):
            raise ValueError(f"weight_sync.checksum must be sum64 or crc32, got {self.checksum!r}.")
        if self.bucket_bytes < B.ALIGN:
            raise ValueError(f"weight_sync.bucket_bytes must be >= {B.ALIGN}, got {self.bucket_bytes}.")


class WeightSender:
    def __init__(self, cfg: WeightSyncConfig, model, ctx: ParallelContext, vocab_size: int, to_hf: ToHF,
                 on_bucket: Optional[BucketHook] = None):
        self.cfg, self.ctx = cfg, ctx
        self.backend = cfg.backend if cfg.backend != "auto" else ("nccl" if ctx.device.type == "cuda" else "gloo")
        self.device = ctx.device if self.backend == "nccl" else torch.device("cpu")
        self.algo = cfg.checksum
        self.weights = StageWeights(model, ctx, vocab_size, to_hf)
        self.is_stage_sender = ctx.tp_rank == 0 and ctx.dp_rank == 0
        self.in_replica = ctx.dp_rank == 0
        self.is_coordinator = ctx.rank == 0
        self.on_bucket = on_bucket
        self.group: Optional[StageGroup] = None
        self.control = WeightSyncControl(cfg.servers, cfg.timeout_s) if self.is_coordinator else None
        self._buffers = DoubleBuffer(self.device)
        self._layouts: Optional[list] = None
        """The stage's bucket plan: fixed by the model's structure, so made once."""

    def connect(self) -> None:
        """Join the stage groups (every rank calls; only stage senders join a group)."""
        host = self.cfg.advertise_host or socket.gethostname()
        mine = (self.ctx.pp_rank, host) if self.is_stage_sender else None
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        hosts = dict(e for e in everyone if e is not None)
        stages = [Endpoint(host=hosts[s], port=self.cfg.base_port + s) for s in range(self.ctx.dims.pp)]
        sizes = [self.control.workers_per_server() if self.is_coordinator else None]
        dist.broadcast_object_list(sizes, src=0)
        world = 1 + sum(sizes[0])
        pending = []
        if self.is_coordinator:
            offsets = [1 + sum(sizes[0][:i]) for i in range(len(sizes[0]))]
            pending = self.control.init_async([
                TransferInit(backend=self.backend, stages=stages, world_size=world, rank_offset=o,
                             timeout_s=self.cfg.timeout_s) for o in offsets])
        if self.is_stage_sender:
            self.group = join_stage_group(stages[self.ctx.pp_rank], 0, world, self.backend, self.cfg.timeout_s,
                                          self.device)
        for f in pending:
            f.result()
        dist.barrier()

    def _send_stage(self, version: int) -> tuple[int, int]:
        if self._layouts is None:
            self._layouts = B.plan_buckets(self.weights.metadata(), self.cfg.bucket_bytes)
        layouts = self._layouts
        plan = StagePlan(version=version, stage=self.ctx.pp_rank, num_stages=self.ctx.dims.pp, checksum=self.algo,
                         buckets=layouts)
        send_stage(self.group, plan, self.weights.hf_tensors(self.device), self._buffers, self.on_bucket)
        return plan.nbytes, len(layouts)

    def push(self, version: int) -> SyncReport:
        """Send this step's weights as ``version``; returns the (coordinator's) report on every rank."""
        t0 = time.perf_counter()
        if self.is_coordinator:
            self.control.start()
        nbytes = nbuckets = 0
        if self.is_stage_sender:
            nbytes, nbuckets = self._send_stage(version)
        elif self.in_replica:
            self.weights.gather_only()
        send_s = time.perf_counter() - t0
        report = [self._finish(version, t0, send_s, nbytes, nbuckets) if self.is_coordinator else None]
        dist.broadcast_object_list(report, src=0)
        return report[0]

    def _finish(self, version: int, t0: float, send_s: float, nbytes: int, nbuckets: int) -> SyncReport:
        control = self.control
        paused = time.perf_counter()
        control.pause()
        try:
            rejected = control.update(UpdateRequest(version=version, num_stages=self.ctx.dims.pp))
            accepted = [s for s in control.servers if s not in rejected]
            control.finish(accepted, version)
        finally:
            control.resume()
        pause_s = time.perf_counter() - paused
        return SyncReport(version=version, accepted=not rejected, servers=control.servers, rejected=rejected,
                          nbytes=nbytes, num_buckets=nbuckets, send_s=send_s, pause_s=pause_s,
                          total_s=time.perf_counter() - t0)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        if self.control is not None:
            self.control.close()
