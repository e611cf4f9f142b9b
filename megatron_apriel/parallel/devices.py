"""One machine's GPUs shared between the vLLM fleet and the trainer (``launch.gpus_per_node``).

The servers come first, each taking ``--tensor-parallel-size x --pipeline-parallel-size x
--data-parallel-size`` GPUs in order; the trainer's ``launch.nproc_per_node`` ranks take the next
ones; what is left stays idle.
Each process gets its own ``CUDA_VISIBLE_DEVICES``, fixed when the launch is laid out, so a
restarted server gets the same GPUs back. The indices are those of the launcher's own
``CUDA_VISIBLE_DEVICES`` when it has one (a SLURM allocation, or a user who set it).
``launch.gpus_per_node=0`` (a CPU machine) assigns nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional


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
    if visible is None:
        devices = [str(i) for i in range(gpus_per_node)]
    else:  # set, even to "": that many GPUs are visible (an empty one hides them all)
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    if len(devices) < gpus_per_node:
        shown = visible if visible else '""'
        raise ValueError(f"launch.gpus_per_node={gpus_per_node} but CUDA_VISIBLE_DEVICES={shown} shows "
                         f"{len(devices)}: lower launch.gpus_per_node, or make the GPUs visible (unset "
                         "CUDA_VISIBLE_DEVICES; under SLURM a step sees only the GPUs it was given: ask for them "
                         "with --gpus-per-node, and run the step with --gpu-bind=none).")
    fleet = num_servers * gpus_per_server
    if fleet + trainer_ranks > gpus_per_node:
        raise ValueError(
            f"launch.gpus_per_node={gpus_per_node} cannot hold fleet.num_servers={num_servers} x {gpus_per_server} "
            f"GPU(s) per server (--tensor-parallel-size x --pipeline-parallel-size x --data-parallel-size in "
            f"fleet.vllm_args) plus "
            f"launch.nproc_per_node={trainer_ranks} trainer ranks (one GPU each): lower fleet.num_servers or "
            f"launch.nproc_per_node, or raise launch.gpus_per_node.")
    servers = tuple(",".join(devices[i * gpus_per_server:(i + 1) * gpus_per_server]) for i in range(num_servers))
    trainer = ",".join(devices[fleet:fleet + trainer_ranks])
    return DeviceSplit(servers, trainer, tuple(devices[fleet + trainer_ranks:gpus_per_node]))


def check_gpus_present(gpus_per_node: int, local_servers: int, present: int) -> None:
    """Refuse a launch that would share a GPU between processes by accident: GPUs are present, the
    launch starts servers here and ``launch.gpus_per_node`` is 0 (every server and trainer rank
    would see every GPU: vLLM takes most of GPU 0's memory, trainer rank 0 runs out of it and NCCL
    fails with "Duplicate GPU"), or it names more GPUs than are present."""
    if present and local_servers and gpus_per_node == 0:
        raise ValueError(f"this machine has {present} GPU(s) and the launch starts {local_servers} vLLM server(s) "
                         f"beside the trainer, but launch.gpus_per_node=0 would give every process every GPU: "
                         f"set launch.gpus_per_node={present} to split them (servers first, then the trainer's "
                         "ranks), or give the servers' URLs in fleet.servers.")
    if gpus_per_node > present > 0:
        raise ValueError(f"launch.gpus_per_node={gpus_per_node} but this machine shows {present} GPU(s): set "
                         f"launch.gpus_per_node={present}.")


def gpus_present(env: Mapping[str, str], dev: Path = Path("/dev")) -> int:
    """The NVIDIA GPUs this process could use, without starting CUDA: the ``/dev/nvidiaN`` device
    files, as many as ``CUDA_VISIBLE_DEVICES`` leaves visible when it is set (0 on a CPU machine,
    whatever that variable says)."""
    devices = [f for f in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", f.name)]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(devices)
    return min(len(devices), len([d for d in visible.split(",") if d.strip()]))
