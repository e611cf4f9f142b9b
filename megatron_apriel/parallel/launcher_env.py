"""Is this process a trainer rank under a launcher, and which one? The one place that maps SLURM's
task variables to torch.distributed's (pure: reads a mapping, returns one).

- torchrun (or a user) set ``RANK``: the process is a rank; nothing to map.
- ``srun`` runs one task per rank: SLURM sets ``SLURM_STEP_ID`` (only inside a job step, never in
  the batch script, which has ``SLURM_PROCID=0`` too), ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``, ``SLURM_NODEID`` and ``SLURM_STEP_TASKS_PER_NODE``. They become ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (node index in the step)
  and ``NODE_RANK``. The rendezvous address cannot be derived per task: ``MASTER_ADDR`` and
  ``MASTER_PORT`` must be in the environment (``slurm/train.sbatch`` exports them from the first
  trainer node's address). Within a heterogeneous job each ``srun --het-group=K`` step counts its
  own tasks, so the trainer's group is its own world.
- A one-task ``srun`` step without ``MASTER_ADDR`` is a whole run on one node (the local
  launcher), as outside SLURM. A several-task step without it is an error: each task would start
  its own one-rank run writing into the same run directory.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
              "MASTER_ADDR", "MASTER_PORT")
"""What torch.distributed and our ``init_parallel`` read (the env:// rendezvous)."""


def tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed tasks-per-node list, expanded: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"cannot parse SLURM tasks-per-node {spec!r} (expected e.g. '8(x4),2').")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Inside an ``srun`` job step (not the batch script, which has no ``SLURM_STEP_ID``)."""
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env


def trainer_rank_env(env: Mapping[str, str]) -> Optional[dict[str, str]]:
    """The variables to add for this process to run as a trainer rank, ``{}`` when a launcher
    already set them (torchrun), or None when the process is not a rank (the local launcher)."""
    if "RANK" in env:
        return {}
    if not in_slurm_step(env):
        return None
    ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"])
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        if ntasks == 1:
            return None
        raise ValueError(
            f"srun started {ntasks} tasks but MASTER_ADDR/MASTER_PORT are not set, so they cannot form one "
            "trainer world: export MASTER_ADDR (the first trainer node's address, e.g. from `scontrol show "
            "hostnames \"$SLURM_JOB_NODELIST\" | head -n1`) and MASTER_PORT before srun, as slurm/train.sbatch "
            "does; or run one task (the local launcher)."
        )
    node = int(env.get("SLURM_NODEID", "0"))
    per_node_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    per_node = tasks_per_node(per_node_spec) if per_node_spec else [ntasks]
    if node >= len(per_node):
        raise ValueError(f"SLURM_NODEID={node} is outside the step's tasks-per-node list {per_node_spec!r}.")
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(ntasks),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(per_node[node]),
        "GROUP_RANK": str(node),
        "NODE_RANK": str(node),
        "MASTER_ADDR": env["MASTER_ADDR"],
        "MASTER_PORT": env["MASTER_PORT"],
    }
