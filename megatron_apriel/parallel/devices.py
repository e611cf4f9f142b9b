"""One machine's GPUs shared between the vLLM fleet and the trainer (``launch.gpus_per_node``).

The servers come first, each taking ``--tensor-parallel-size x --pipeline-parallel-size`` GPUs in
order; the trainer's ``launch.nproc_per_node`` ranks take the next ones; what is left stays idle.
Each process gets its own ``CUDA_VISIBLE_DEVICES``, fixed when the launch is laid out, so a
restarted server gets the same GPUs back. The indices are those of the launcher's own
``CUDA_VISIBLE_DEVICES`` when it has one (a SLURM allocation, or a user who set it).
``launch.gpus_per_node=0`` (a CPU machine) assigns nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DeviceSplit:
    servers: tuple[str, ...]
    """The CUDA_VISIBLE_DEVICES of each server, in order."""
    trainer: str
    """The trainer's (torchrun's ranks take them by local rank)."""
    idle: tuple[str, ...] = ()
    """GPUs nobody was given."""


def split_devices(gpus_per_node: int, num_servers: int, gpus_per_server: int, trainer_ranks: int,
                  visible: Optional[str] = None) -> Optional[DeviceSplit]:
    """The split described in the module docstring; None when ``gpus_per_node`` is 0. A split that
    needs more GPUs than the node has, or leaves the trainer with none, is refused naming the keys."""
    if gpus_per_node == 0:
        return None
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
    devices = devices or [str(i) for i in range(gpus_per_node)]
    if len(devices) < gpus_per_node:
        raise ValueError(f"launch.gpus_per_node={gpus_per_node} but CUDA_VISIBLE_DEVICES={visible} shows "
                         f"{len(devices)}: lower launch.gpus_per_node or unset CUDA_VISIBLE_DEVICES.")
    fleet = num_servers * gpus_per_server
    if fleet + trainer_ranks > gpus_per_node:
        raise ValueError(
            f"launch.gpus_per_node={gpus_per_node} cannot hold fleet.num_servers={num_servers} x {gpus_per_server} "
            f"GPU(s) per server (--tensor-parallel-size x --pipeline-parallel-size in fleet.vllm_args) plus "
            f"launch.nproc_per_node={trainer_ranks} trainer ranks (one GPU each): lower fleet.num_servers or "
            f"launch.nproc_per_node, or raise launch.gpus_per_node.")
    servers = tuple(",".join(devices[i * gpus_per_server:(i + 1) * gpus_per_server]) for i in range(num_servers))
    trainer = ",".join(devices[fleet:fleet + trainer_ranks])
    return DeviceSplit(servers, trainer, tuple(devices[fleet + trainer_ranks:gpus_per_node]))
