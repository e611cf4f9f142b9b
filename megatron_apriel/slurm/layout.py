"""The SLURM job a run needs (trainer nodes, rollout nodes, servers and GPUs per node), derived
from its config and checked against it before submission and again inside the job (pure).

Two shapes: the trainer and the fleet on nodes of their own (a heterogeneous job, or a plain one
whose first ``launch.nnodes`` nodes train); or, with ``launch.gpus_per_node > 0``, one node that
they share, its GPUs split as the local launch splits them (``parallel/devices.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from megatron_apriel.config import RunConfig
from megatron_apriel.parallel.devices import DeviceSplit, split_devices
from megatron_apriel.parallel.dims import ParallelDims

ONE_NODE_ENV = "APRIEL_ONE_NODE"
"""Set to 1 by slurm/train.sbatch in every step of a job whose one node the trainer and the fleet share."""


def node_address(addrs: str, node: str) -> str:
    """``node``'s address in ``APRIEL_NODE_ADDRS`` ("n1=10.0.0.1 n2=10.0.0.2")."""
    table = dict(pair.split("=", 1) for pair in addrs.split())
    if node not in table:
        raise ValueError(f"node {node} is not in APRIEL_NODE_ADDRS={addrs!r} (set by slurm/train.sbatch).")
    return table[node]


def job_node_address(env: Mapping[str, str]) -> Optional[str]:
    """This node's address inside a step of slurm/train.sbatch (SLURM's NodeAddr, which the other
    nodes reach, not necessarily the host name); None outside such a job."""
    if not env.get("APRIEL_NODE_ADDRS") or not env.get("SLURMD_NODENAME"):
        return None
    return node_address(env["APRIEL_NODE_ADDRS"], env["SLURMD_NODENAME"])


@dataclass(frozen=True)
class JobLayout:
    train_nodes: int
    train_tasks_per_node: int
    rollout_nodes: int
    servers_per_node: int
    gpus_per_node: int
    """0 on CPU nodes."""
    gpus_per_server: int
    """--tensor-parallel-size x --pipeline-parallel-size x --data-parallel-size of each server."""
    one_node: bool = False
    """The trainer and the fleet share one node (``launch.gpus_per_node``): one plain job of one node,
    whatever ``slurm.hetjob`` says."""

    @property
    def total_nodes(self) -> int:
        return 1 if self.one_node else self.train_nodes + self.rollout_nodes

    @property
    def num_servers(self) -> int:
        return self.rollout_nodes * self.servers_per_node


def _check_run(run: RunConfig) -> None:
    """What any SLURM job of ours needs from the run, whatever the nodes."""
    if run.rollout.source != "fleet":
        raise ValueError(f"rollout.source={run.rollout.source}: the SLURM job runs the vLLM fleet and the actor; "
                         "for the trainer alone write the run directory with `apriel-train ... launch.dry_run=false` "
                         "on one node, or run `srun ... python -m megatron_apriel.entrypoints.trainer_rank --run-dir "
                         "RUN_DIR` on a run directory its launcher prepared.")
    if run.fleet.servers:
        raise ValueError(f"fleet.servers={run.fleet.servers}: the SLURM job starts its own fleet; leave fleet.servers "
                         "empty and set fleet.num_servers.")
    if not run.checkpoint.save_at_end:
        raise ValueError("checkpoint.save_at_end=false: the job tells a finished run from a stopped one by its last "
                         "checkpoint; set checkpoint.save_at_end=true.")


def one_node_split(run: RunConfig, visible: Optional[str] = None) -> DeviceSplit:
    """The GPUs of each process on a node the trainer and the fleet share, over ``visible`` (a task's
    CUDA_VISIBLE_DEVICES; None: 0..launch.gpus_per_node-1): the local launch's split."""
    return split_devices(run.launch.gpus_per_node, run.fleet.num_servers, run.fleet.server_args.gpus,
                         run.launch.nproc_per_node, visible)


def _one_node_layout(run: RunConfig) -> JobLayout:
    """``launch.gpus_per_node > 0``: the servers and the trainer's ranks on one node's GPUs."""
    launch, s, fleet = run.launch, run.slurm, run.fleet
    gpus = launch.gpus_per_node
    if launch.nnodes != 1:
        raise ValueError(f"launch.gpus_per_node={gpus} shares one node between the fleet and the trainer, but "
                         f"launch.nnodes={launch.nnodes}: set launch.nnodes=1, or launch.gpus_per_node=0 to give the "
                         "trainer and the fleet nodes of their own.")
    if s.gpus_per_node not in (0, gpus):
        raise ValueError(f"launch.gpus_per_node={gpus} but slurm.gpus_per_node={s.gpus_per_node}: on one node both "
                         f"are the node's GPUs; set slurm.gpus_per_node={gpus} (or 0 on a cluster that does not "
                         "schedule GPUs as GRES: the job then hands out GPUs 0..N-1 itself).")
    if s.servers_per_node not in (0, fleet.num_servers):
        raise ValueError(f"slurm.servers_per_node={s.servers_per_node} but one node runs all fleet.num_servers="
                         f"{fleet.num_servers} servers: set slurm.servers_per_node=0.")
    one_node_split(run)  # raises naming the keys
    ParallelDims.resolve(run.parallel, launch.nproc_per_node)
    return JobLayout(train_nodes=1, train_tasks_per_node=launch.nproc_per_node, rollout_nodes=1,
                     servers_per_node=fleet.num_servers, gpus_per_node=s.gpus_per_node,
                     gpus_per_server=fleet.server_args.gpus, one_node=True)


def job_layout(run: RunConfig) -> JobLayout:
    """The layout ``run`` needs on ``run.slurm``'s nodes, or a ValueError naming the key to change."""
    _check_run(run)
    if run.launch.gpus_per_node:
        return _one_node_layout(run)
    s = run.slurm
    tp, pp, ranks = run.parallel.tp, run.parallel.pp, run.launch.nproc_per_node
    vllm_tp = run.fleet.server_args.gpus  # --tensor-parallel-size x --pipeline-parallel-size x --data-parallel-size
    if s.gpus_per_node:
        world = run.launch.nnodes * s.gpus_per_node
        if world % (tp * pp):
            raise ValueError(f"launch.nnodes={run.launch.nnodes} x slurm.gpus_per_node={s.gpus_per_node} = {world} "
                             f"trainer GPUs is not a multiple of parallel.tp x parallel.pp = {tp} x {pp}: use a "
                             f"multiple of {tp * pp} GPUs (launch.nnodes) or change parallel.tp / parallel.pp.")
        if ranks != s.gpus_per_node:
            raise ValueError(f"launch.nproc_per_node={ranks} trainer ranks per node but slurm.gpus_per_node="
                             f"{s.gpus_per_node}: one rank per GPU, set launch.nproc_per_node={s.gpus_per_node}.")
        if tp > s.gpus_per_node or s.gpus_per_node % tp:
            raise ValueError(f"parallel.tp={tp} must divide slurm.gpus_per_node={s.gpus_per_node} (tensor parallelism "
                             "stays inside a node): choose tp among its divisors.")
        if vllm_tp > s.gpus_per_node or s.gpus_per_node % vllm_tp:
            raise ValueError(f"each server's {vllm_tp} GPUs (--tensor-parallel-size x --pipeline-parallel-size x "
                             f"--data-parallel-size) must divide slurm.gpus_per_node={s.gpus_per_node}; change them "
                             "in fleet.vllm_args.")
        per_node = s.servers_per_node or s.gpus_per_node // vllm_tp
        if per_node * vllm_tp > s.gpus_per_node:
            raise ValueError(f"slurm.servers_per_node={per_node} servers x {vllm_tp} GPUs each need "
                             f"{per_node * vllm_tp} GPUs per node, the nodes have {s.gpus_per_node}; "
                             "lower one of them.")
    else:
        per_node = s.servers_per_node
    if run.fleet.num_servers % per_node:
        lo = run.fleet.num_servers // per_node * per_node
        raise ValueError(f"fleet.num_servers={run.fleet.num_servers} does not fill whole rollout nodes of {per_node} "
                         f"servers: use {f'{lo} or ' if lo else ''}{lo + per_node}, or change slurm.servers_per_node.")
    ParallelDims.resolve(run.parallel, run.launch.nnodes * ranks)  # raises with the fix
    return JobLayout(train_nodes=run.launch.nnodes, train_tasks_per_node=ranks,
                     rollout_nodes=run.fleet.num_servers // per_node, servers_per_node=per_node,
                     gpus_per_node=s.gpus_per_node, gpus_per_server=vllm_tp)


def check_allocation(run: RunConfig, train_nodes: int, train_tasks_per_node: int, rollout_nodes: int,
                     servers_per_node: int, one_node: bool = False) -> JobLayout:
    """Inside the job: the allocation SLURM gave (and the script's servers per node) against the
    config's trainer and fleet sizes; a ValueError that says which side to change. Independent of
    ``slurm.*``, so a job submitted by hand needs only its resources and APRIEL_* variables right."""
    _check_run(run)
    launch = run.launch
    if one_node != bool(launch.gpus_per_node):
        raise ValueError(
            f"this job {'shares one node' if one_node else 'puts the trainer and the fleet on nodes of their own'} "
            f"(APRIEL_ONE_NODE={int(one_node)}) but the config has launch.gpus_per_node={launch.gpus_per_node}: "
            "submit with apriel-submit, or set APRIEL_ONE_NODE=1 exactly when launch.gpus_per_node > 0.")
    if one_node:
        one_node_split(run)
    if (train_nodes, train_tasks_per_node) != (launch.nnodes, launch.nproc_per_node) or \
            rollout_nodes * servers_per_node != run.fleet.num_servers:
        raise ValueError(
            f"this job has {train_nodes} trainer node(s) x {train_tasks_per_node} rank(s) and {rollout_nodes} rollout "
            f"node(s) x {servers_per_node} server(s); the config has launch.nnodes={launch.nnodes} x "
            f"launch.nproc_per_node={launch.nproc_per_node} trainer ranks and "
            f"fleet.num_servers={run.fleet.num_servers}. Submit with apriel-submit, or make the sbatch resources "
            "and the APRIEL_* variables match the config."
        )
    ParallelDims.resolve(run.parallel, train_nodes * train_tasks_per_node)
    return JobLayout(train_nodes, train_tasks_per_node, rollout_nodes, servers_per_node, run.slurm.gpus_per_node,
                     run.fleet.server_args.gpus, one_node)
