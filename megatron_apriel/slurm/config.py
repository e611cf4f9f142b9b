"""``slurm.*``: how ``apriel-submit`` places a run on a SLURM cluster (pure: no torch, no SLURM calls)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$")


@dataclass(kw_only=True)
class SlurmConfig:
    """The cluster side of a run. Node counts come from the run itself: ``launch.nnodes`` x
    ``launch.nproc_per_node`` trainer ranks, ``fleet.num_servers`` vLLM servers at
    ``servers_per_node`` per rollout node."""

    partition: Optional[str] = None
    """Partition to submit to; null: the cluster's default partition (there must be one)."""
    account: Optional[str] = None
    """Account to charge; null: the user's default account."""
    qos: Optional[str] = None
    time: str = "36:00:00"
    """Time limit per attempt ([days-]hours:minutes:seconds); a requeued job gets it again."""
    gpus_per_node: int = 8
    """GPUs of each node (0: CPU nodes, as in CI). Trainer ranks per node must equal it."""
    servers_per_node: int = 0
    """vLLM servers per rollout node; 0: gpus_per_node / the servers' --tensor-parallel-size."""
    cpus_per_task: int = 0
    """CPUs for each trainer rank and each vLLM server (srun --cpus-per-task); 0: SLURM's default."""
    hetjob: bool = True
    """A heterogeneous job (trainer nodes = component 0, rollout nodes = component 1). False: one
    plain job whose first launch.nnodes nodes train, for clusters that forbid hetjobs."""
    python: Optional[str] = None
    """The Python (of the venv or container) on the compute nodes; null: the one running apriel-submit."""
    env_file: Optional[str] = None
    """Sourced by the job before anything starts: per-cluster network settings (NCCL_SOCKET_IFNAME,
    NCCL_IB_HCA, ...), module loads. Null: the shipped slurm/cluster.env."""
    signal_s: int = 600
    """SLURM signals the job (SIGUSR1) this many seconds before its time limit: the trainer finishes
    its step, saves a checkpoint and the job requeues itself. Must cover one step plus a checkpoint."""
    max_requeues: int = 10
    """Requeues after a stop signal before the job gives up (SLURM_RESTART_COUNT)."""
    stop_grace_s: int = 60
    """After SIGTERM, how long a component may take to exit before its step is cancelled."""
    port_base: int = 0
    """First of the job's ports (trainer rendezvous, weight sync from +1, servers from +50);
    0: 20000 + 100 * (job id % 400), so two jobs on one node do not collide."""
    shared_roots: list[str] = field(default_factory=list)
    """Directories known to be shared by the login and compute nodes, on top of the network
    filesystems apriel-submit recognises (NFS, Lustre, GPFS, BeeGFS, WekaFS, CephFS, ...)."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra #SBATCH options for every component, e.g. [--constraint=h100, --reservation=rl]."""
    srun_args: list[str] = field(default_factory=list)
    """Extra options for every srun, e.g. containers:
    [--container-image=/img/apriel.sqsh, --container-mounts=/shared]."""
    exclusive: bool = True
    """Whole nodes (#SBATCH --exclusive): the job's ports and GPUs are its own."""

    def __post_init__(self) -> None:
        if not _TIME.match(self.time):
            raise ValueError(f"slurm.time={self.time!r} is not a SLURM time; use e.g. 36:00:00 or 1-12:00:00.")
        if self.gpus_per_node < 0 or self.servers_per_node < 0:
            raise ValueError("slurm.gpus_per_node and slurm.servers_per_node must be >= 0.")
        if self.gpus_per_node == 0 and self.servers_per_node == 0:
            raise ValueError("slurm.gpus_per_node=0 (CPU nodes): set slurm.servers_per_node (vLLM servers per node).")
        if self.cpus_per_task < 0:
            raise ValueError("slurm.cpus_per_task must be >= 0 (0: SLURM's default).")
        if self.signal_s < 0 or self.max_requeues < 0 or self.stop_grace_s < 1:
            raise ValueError("slurm.signal_s and max_requeues must be >= 0 and slurm.stop_grace_s >= 1.")
        if self.port_base and not 1024 <= self.port_base <= 65000:
            raise ValueError(f"slurm.port_base={self.port_base}: use 0 (derived from the job id) or a port in "
                             "1024..65000.")
