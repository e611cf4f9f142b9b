"""One process group per trainer pipeline stage, joining the stage's sender (rank 0) with every
vLLM worker; built from plain torch so both sides share it and the trainer never imports vLLM.

The groups are "stateless": a ``TCPStore`` hosted by the sender at the stage's endpoint, outside
the trainer's default group and outside vLLM's own groups. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_apriel.records.weights import Endpoint, StagePlan, parse_message

_HEADER_WORDS = 2  # [protocol-agnostic magic, JSON byte length]
_MAGIC = 0x41505249  # "APRI"


@dataclass
class StageGroup:
    """A joined group: ``rank`` 0 sends, everyone else receives."""

    pg: object
    rank: int
    world_size: int
    device: torch.device
    store: object  # keeps the TCPStore (and, on rank 0, its server) alive

    def broadcast(self, tensor: torch.Tensor, async_op: bool = False):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self.pg.broadcast([tensor], opts)
        if async_op:
            return work
        work.wait()
        return None

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            shutdown()


def host_stage_store(host: str, port: int, world_size: int, timeout_s: float) -> tuple[object, Endpoint]:
    """The sender's side of a stage's rendezvous: its ``TCPStore`` bound on ``port`` and the endpoint
    the servers join at. ``port`` 0 binds a free port: the bind itself chooses it, so no other run
    on the node can take it between the choice and the use (two runs on one node never collide)."""
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, use_libuv=True)
    return store, Endpoint(host=host, port=store.port)


def join_stage_group(endpoint: Endpoint, rank: int, world_size: int, backend: str, timeout_s: float,
                     device: torch.device, store: object = None) -> StageGroup:
    """Block until all ``world_size`` members joined the group at ``endpoint``. The sender (rank 0)
    passes the ``store`` it hosts (`host_stage_store`); without one, rank 0 binds ``endpoint.port``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(endpoint.host, endpoint.port, world_size, is_master=(rank == 0), timeout=timeout,
                              wait_for_workers=False, use_libuv=True)
    prefixed = dist.PrefixStore(f"apriel_weight_sync/{endpoint.host}:{endpoint.port}", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        raise ValueError(f"weight_sync backend must be gloo or nccl, got {backend!r}.")
    group = StageGroup(pg=pg, rank=rank, world_size=world_size, device=device, store=store)
    group.broadcast(torch.zeros(1, device=device))  # completes the rendezvous on every member now
    return group


def send_plan(group: StageGroup, plan: StagePlan) -> None:
    body = torch.frombuffer(bytearray(plan.model_dump_json().encode()), dtype=torch.uint8)
    header = torch.tensor([_MAGIC, body.numel()], dtype=torch.int64)
    group.broadcast(header.to(group.device))
    group.broadcast(body.to(group.device))


def recv_plan(group: StageGroup) -> StagePlan:
    header = torch.zeros(_HEADER_WORDS, dtype=torch.int64, device=group.device)
    group.broadcast(header)
    magic, length = header.tolist()
    if magic != _MAGIC:
        raise RuntimeError(f"weight-sync stream out of step: expected a plan header, got magic {magic:#x}.")
    body = torch.empty(length, dtype=torch.uint8, device=group.device)
    group.broadcast(body)
    message = parse_message(bytes(body.cpu().numpy()))
    if not isinstance(message, StagePlan):
        raise RuntimeError(f"expected a stage plan on the weight-sync group, got {message.kind}.")
    return message
