"""A real SLURM on this machine (tools/setup_slurm.sh: munge, slurmctld, two virtual nodes n1 n2 on
127.0.0.1) for every test marked ``slurm``, and helpers to submit the shipped scripts and watch
the jobs. Setting SLURM up needs root: the tests skip without it, and fail under CI instead.
The jobs run in the session's background (tests/background.py): these helpers run on its thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.background import STOPPING, at_end
from tests.ci import skip_or_fail
from tests.unit.conftest import launcher_env

REPO = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: submits jobs to a real local SLURM (tools/setup_slurm.sh, needs root)")


_cluster_lock = threading.Lock()
_cluster_up = False


def ensure_cluster() -> None:
    """Start the cluster if this session has not (each scenario calls it first, on the background
    thread); it is stopped after the session's last scenario if this session started it (a cluster
    that was up before is left as it was)."""
    global _cluster_up
    with _cluster_lock:
        if _cluster_up:
            return
        if os.geteuid() != 0:
            skip_or_fail(f"the SLURM tests start slurmctld/slurmd and need root, this runs as uid {os.geteuid()}")
        script = str(REPO / "tools" / "setup_slurm.sh")
        was_up = subprocess.run(["bash", script, "status"], capture_output=True).returncode == 0
        proc = subprocess.run(["bash", script], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"tools/setup_slurm.sh failed:\n{proc.stdout}\n{proc.stderr}"
        _cluster_up = True
        if not was_up:
            at_end(lambda: stop_cluster(script))


def stop_cluster(script: str) -> None:
    stopped = subprocess.run(["bash", script, "stop"], capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, f"tools/setup_slurm.sh stop failed:\n{stopped.stderr}"


def job_env(**extra: str) -> dict:
    """A user's shell (no rendezvous variables), this checkout importable on the nodes, and every
    path shared: the two virtual nodes are one machine."""
    env = launcher_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["APRIEL_SHARED_ROOTS"] = "/"
    env.update(extra)
    return env


def squeue_has(job: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i"], capture_output=True, text=True).stdout
    return bool(out.strip())


def job_field(job: str, key: str) -> str:
    """``key`` of ``scontrol show job`` (kept for MinJobAge after the end)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    for word in out.split("\n")[0].split():
        if word.startswith(key + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"no {key} in scontrol show job {job}: {out}")


def wait_gone(job: str, timeout_s: float, log: Path) -> float:
    """Seconds until ``job`` has left the queue (pending, running or requeued)."""
    t0 = time.monotonic()
    while squeue_has(job):
        if time.monotonic() - t0 > timeout_s:
            subprocess.run(["scancel", job])
            pytest.fail(f"job {job} still in the queue after {timeout_s}s; job log:\n{tail(log)}")
        give_up_if_stopping(job)
        time.sleep(1)
    return time.monotonic() - t0


def wait_for(cond, timeout_s: float, what: str, job: str, log: Path) -> None:
    t0 = time.monotonic()
    while not cond():
        if not squeue_has(job):
            pytest.fail(f"job {job} ended while waiting for {what}; job log:\n{tail(log)}")
        if time.monotonic() - t0 > timeout_s:
            subprocess.run(["scancel", job])
            pytest.fail(f"no {what} after {timeout_s}s; job log:\n{tail(log)}")
        give_up_if_stopping(job)
        time.sleep(0.5)


def give_up_if_stopping(job: str) -> None:
    """The session ended before the scenario (tests/background.py): cancel its job and stop."""
    if STOPPING.is_set():
        subprocess.run(["scancel", job])
        pytest.fail(f"the session ended while job {job} ran; it was cancelled")


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else f"({path} missing)"


def component_ids(job: str) -> set[str]:
    """The job ids of ``job``'s components (a hetjob has one per component)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return {w.split("=", 1)[1] for line in out.splitlines() for w in line.split() if w.startswith("JobId=")}


def leftovers(run: Path, job: str) -> list[str]:
    """Live processes of the job: any with one of its job ids in its environment (SLURM sets it in
    every task, and children inherit it, including vLLM's renamed engine processes), or whose
    command line names the run directory."""
    ids, found = component_ids(job), []
    assert ids, f"scontrol no longer knows job {job}"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
        except PermissionError:
            continue  # not ours to read even as root (pid 1 of a container): not a job process either
        if any(e.decode(errors="replace") in {f"SLURM_JOB_ID={i}" for i in ids} for e in environ) \
                or str(run) in cmdline:
            found.append(f"{proc.name} {cmdline}")
    return found


def submit_cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_apriel.entrypoints.submit", *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO)
