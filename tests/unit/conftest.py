import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.records.rollouts import Problem
from tests.ci import skip_or_fail


def make_problem(domain, reference, prompt="solve", pid="t"):
    return Problem(id=pid, domain=domain, prompt=[{"role": "user", "content": prompt}], reference=reference)


def apriel(answer: str, reasoning: str = "Here are my reasoning steps:\nthinking...") -> str:
    """A completion in Apriel's output format."""
    return f"{reasoning}\n[BEGIN FINAL RESPONSE]\n{answer}\n[END FINAL RESPONSE]"


def launcher_env() -> dict:
    """The environment of a user's shell: no rendezvous variables from an enclosing launcher."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return dict({k: v for k, v in os.environ.items() if k not in drop}, PYTHONWARNINGS="ignore")


def assert_all_exit(processes: list, timeout_s: float = 180) -> None:
    """Wait until every one of ``processes`` (psutil) has exited; those still running after
    ``timeout_s`` are killed (by pid: the test's own) and named in the failure."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while alive := [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
        if time.monotonic() > deadline:
            left = [(p.pid, " ".join(p.cmdline())[:200]) for p in alive]
            for p in alive:
                p.kill()
            raise AssertionError(f"left running: {left}")
        time.sleep(0.1)


def require_root() -> None:
    """Skip the calling test unless it runs as root; under CI, fail it instead (see tests/ci.py)."""
    if os.geteuid() != 0:
        skip_or_fail(f"the namespace sandbox needs root, this runs as uid {os.geteuid()}: run the suite as root")


@pytest.fixture
def needs_root():
    require_root()


REPO = Path(__file__).resolve().parents[2]


def run_dist(script: str, *args: str, ranks: int = 2, timeout: int = 900) -> None:
    """Run ``tests/dist/<script>`` under ``torchrun --nproc_per_node ranks`` (gloo ranks on this
    machine, the repository importable); fail with the tail of its output if it fails."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), str(REPO / "tests" / "dist" / script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
