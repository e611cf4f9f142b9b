"""What ``apriel-submit`` checks against the cluster before submitting: the partition and account
exist (``sinfo``, ``sacctmgr``, when the cluster has them), the partition has the nodes, and the
paths the job uses are on a filesystem the compute nodes share. Each check returns the problems
it found as messages that say what to change; the cluster queries are passed in as functions so
the checks are tested without a cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Optional

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
        return ["sinfo is not available or failed: run apriel-submit on a login node of the cluster (or use --dry-run)."]
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
