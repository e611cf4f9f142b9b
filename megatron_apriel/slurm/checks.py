"""What ``apriel-submit`` checks against the cluster before submitting: the partition and account
exist (``sinfo``, ``sacctmgr``, when the cluster has them), the partition has the nodes, and the
paths the job uses are on a filesystem the compute nodes share. Each check returns the problems
it found as messages that say what to change; the cluster queries are passed in as functions so
the checks are tested without a cluster."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Optional

from megatron_apriel.run_dir import RunDir
from megatron_apriel.stop import STOP_COST_FILE

LOCAL_ONLY = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/scratch/local", "/local")
"""Node-local by convention: refused unless listed in slurm.shared_roots / APRIEL_SHARED_ROOTS."""
NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "wekafs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
              "panfs", "cifs", "smb3", "fuse.sshfs", "fuse.weka", "orangefs", "pvfs2", "fuse.juicefs", "vast"}
"""Filesystem types (``/proc/mounts``) taken as shared by the login and compute nodes."""
SHARED_ROOTS_ENV = "APRIEL_SHARED_ROOTS"
"""Colon-separated directories known to be shared by all nodes (on top of slurm.shared_roots)."""


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _existing(path: Path) -> Path:
    """``path`` with the symlinks of its existing part resolved (a run directory may not exist yet)."""
    path, tail = Path(os.path.abspath(path)), []
    while not path.exists() and path != path.parent:
        tail.insert(0, path.name)
        path = path.parent
    return path.resolve().joinpath(*tail)


def mount_of(path: Path, mounts_text: str) -> tuple[str, str]:
    """(mount point, filesystem type) of ``path`` from the text of ``/proc/mounts``."""
    best = ("/", "unknown")
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if _under(path, Path(point)) and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def shared_roots(configured: list[str], env: dict) -> list[Path]:
    extra = [p for p in env.get(SHARED_ROOTS_ENV, "").split(":") if p]
    return [_existing(Path(p)) for p in [*configured, *extra]]


def path_problem(what: str, path: str, roots: list[Path], mounts_text: str) -> Optional[str]:
    """Why ``path`` may not be visible from the compute nodes, or None."""
    p = _existing(Path(path))
    if any(_under(p, r) for r in roots):
        return None
    shown = f"{path} ({p})" if str(p) != path else path
    fix = (f"put it on a filesystem every node mounts, or, if {shown} is shared by all nodes, add its directory to "
           f"slurm.shared_roots (or {SHARED_ROOTS_ENV}, colon-separated).")
    local = next((d for d in LOCAL_ONLY if _under(p, Path(d))), None)
    if local:
        return f"{what}={path} is under {local}, which is local to each node: {fix}"
    point, fstype = mount_of(p, mounts_text)
    if fstype not in NETWORK_FS:
        return f"{what}={path} is on a local {fstype} filesystem (mounted at {point}), not a shared one: {fix}"
    return None


Query = Callable[[list[str]], Optional[str]]
"""Runs a SLURM command; its stdout, or None when the command is absent or fails."""


def run_query(cmd: list[str]) -> Optional[str]:
    if shutil.which(cmd[0]) is None:
        return None
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return proc.stdout if proc.returncode == 0 else None


def partition_problems(partition: Optional[str], nodes_needed: int, query: Query) -> list[str]:
    """The partition exists (or there is a default one) and holds ``nodes_needed`` nodes."""
    out = query(["sinfo", "-h", "-o", "%P %D"])
    if out is None:
        return ["sinfo is not available or failed: run apriel-submit on a login node of the cluster "
                "(or use --dry-run)."]
    sizes: dict[str, int] = {}
    default = None
    for line in out.split("\n"):
        if not line.strip():
            continue
        name, count = line.split()
        if name.endswith("*"):
            name = default = name[:-1]
        sizes[name] = sizes.get(name, 0) + int(count)
    if partition is None and default is None:
        return [f"slurm.partition is not set and the cluster has no default partition: set slurm.partition to one "
                f"of {sorted(sizes)}."]
    name = partition or default
    if name not in sizes:
        return [f"slurm.partition={name} does not exist on this cluster: use one of {sorted(sizes)}."]
    if sizes[name] < nodes_needed:
        return [f"the job needs {nodes_needed} nodes but partition {name} has {sizes[name]}: lower launch.nnodes or "
                f"fleet.num_servers, or choose a larger partition."]
    return []


def account_problems(account: Optional[str], user: str, query: Query) -> tuple[list[str], str]:
    """(problems, note): the account is one of the user's associations, when accounting answers."""
    if account is None:
        return [], "account: the user's default"
    out = query(["sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", "format=account"])
    if out is None:
        return [], f"account {account}: not checked (sacctmgr is not available or accounting is off)"
    accounts = sorted({a.strip() for a in out.split("\n") if a.strip()})
    if account not in accounts:
        return [f"slurm.account={account} is not one of {user}'s accounts {accounts}: set slurm.account to one of "
                "them."], ""
    return [], f"account {account}: found"


_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)")
"""A GPU entry of a node's GRES in ``sinfo`` (``gpu:8``, ``gpu:h100:8(S:0-1)``): its count."""


def _node_gpus(gres: str) -> int:
    return sum(int(m.group(1)) for m in _GPU_GRES.finditer(gres))


def _partition_nodes(partition: Optional[str], out: str) -> tuple[str, dict[str, tuple[int, int]]]:
    """(partition name, {node: (CPUs, GPUs)}) from ``sinfo -N -o '%N %P %c %G'``; None: the default."""
    nodes: dict[str, tuple[int, int]] = {}
    name = partition
    for line in out.split("\n"):
        fields = line.split()
        if len(fields) < 4:
            continue
        part, default = fields[1].rstrip("*"), fields[1].endswith("*")
        if (partition is None and default) or part == partition:
            name = part
            nodes[fields[0]] = (int(fields[2].rstrip("+")), _node_gpus(fields[3]))
    return name or "(default)", nodes


def node_problems(partition: Optional[str], layout, *, hetjob: bool, cpus_per_task: int, query: Query) -> list[str]:
    """Each component's tasks fit the CPUs and GPUs of as many nodes of the partition as it asks for
    (sbatch would answer only "Requested node configuration is not available"). ``layout``: a
    `slurm.layout.JobLayout`."""
    out = query(["sinfo", "-h", "-N", "-o", "%N %P %c %G"])
    if out is None:
        return []  # partition_problems reports the missing sinfo
    name, nodes = _partition_nodes(partition, out)
    if not nodes:
        return []  # partition_problems reports the missing partition
    cpt = max(cpus_per_task, 1)
    if hetjob:
        parts = [("the trainer", layout.train_nodes, layout.train_tasks_per_node, "launch.nproc_per_node"),
                 ("the fleet", layout.rollout_nodes, layout.servers_per_node, "slurm.servers_per_node")]
    else:
        parts = [("the job", layout.total_nodes, max(layout.train_tasks_per_node, layout.servers_per_node),
                  "launch.nproc_per_node or slurm.servers_per_node")]
    sizes = sorted(set(nodes.values()))
    shown = ", ".join(f"{c} CPUs and {g} GPUs" for c, g in sizes)
    found = []
    for what, count, tasks, knob in parts:
        fit = [n for n, (c, g) in nodes.items() if c >= tasks * cpt and g >= layout.gpus_per_node]
        if len(fit) >= count:
            continue
        if not any(g >= layout.gpus_per_node for _, g in nodes.values()):
            fix = (f"set slurm.gpus_per_node to what the nodes have, or choose a partition with "
                   f"{layout.gpus_per_node}-GPU nodes")
        else:
            fix = f"lower {knob} (or slurm.cpus_per_task), or choose a partition with larger nodes"
        found.append(f"{what} needs {count} node(s) with {tasks * cpt} CPUs ({tasks} task(s) x {cpt} CPU) and "
                     f"{layout.gpus_per_node} GPUs each, but partition {name} has {len(fit)} such node(s) (its nodes: "
                     f"{shown}): {fix}.")
    return found


def stop_time_notes(run_dir: str, signal_s: int, query: Query) -> list[str]:
    """What SLURM gives the trainer to stop, against what a stop measured in ``run_dir`` takes
    (``stop_seconds`` of the newest checkpoint, written by the trainer at each save): KillWait after a SIGTERM
    (scancel, time limit, preemption) and ``slurm.signal_s`` after the time-limit warning."""
    match = re.search(r"^KillWait\s*=\s*(\d+)", query(["scontrol", "show", "config"]) or "", re.M)
    kill_wait = int(match.group(1)) if match else None
    latest = RunDir(run_dir).checkpoints / "latest"
    cost = latest.parent / latest.read_text().strip() / STOP_COST_FILE if latest.is_file() else None
    if cost is None or not cost.is_file():
        return [f"stop time: not measured yet (at the trainer's first save); SLURM's KillWait {kill_wait}s"
                if kill_wait is not None else "stop time: not measured yet (at the trainer's first save)"]
    need = int(cost.read_text().strip() or 0)
    notes = [f"the trainer's measured stop takes {need}s ({cost})"]
    if kill_wait is not None and need > kill_wait:
        notes.append(f"warning: SLURM's KillWait is {kill_wait}s: after a scancel, the time limit or a preemption the "
                     "trainer may be killed mid-save (the previous checkpoint is then the one resumed)")
    if need > signal_s:
        notes.append(f"warning: slurm.signal_s={signal_s} is shorter than that: raise it so the time-limit warning "
                     "leaves time to save")
    return notes
