"""`apriel-serve` killed with SIGKILL leaves no process behind, whichever process is killed:

- apriel-serve itself (what a user's `kill -9` or a dying launcher does): its vLLM server gets
  SIGTERM (parent-death signal) and stops its engine and workers;
- the vLLM API server it runs (the registered pid; what the OOM killer picks, the biggest process):
  apriel-serve kills the engine and workers that server left and dies by the same signal, so
  whoever waits on apriel-serve (a launcher, srun) sees the server's SIGKILL.

A bare vLLM API server killed this way leaves its engine and worker (~2 GB) running, reparented to
init. Each test waits for the events themselves (registration, then every process gone).
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from megatron_apriel.parallel.rendezvous import free_port
from tests.unit.conftest import assert_all_exit, launcher_env

pytestmark = pytest.mark.vllm


def start(model_dir: str, tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    """apriel-serve as a user starts it (a session of its own, so no signal of this test's group
    reaches it); returns it and its registration, once it answers /health."""
    fleet = tmp_path / "fleet"
    proc = subprocess.Popen([shutil.which("apriel-serve"), "--model", model_dir, "--host", "127.0.0.1", "--port",
                             str(free_port()), "--max-model-len", "256", "--register-dir", str(fleet)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "w"), env=launcher_env(),
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not list(fleet.glob("*.json")):
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "apriel-serve never registered"
        time.sleep(0.2)
    (reg,) = [json.loads(p.read_text()) for p in fleet.glob("*.json")]
    return proc, reg


def family(proc: subprocess.Popen) -> list[psutil.Process]:
    out = [p for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
           if p.status() != psutil.STATUS_ZOMBIE]  # the registration helper, once done, waits to be reaped
    names = " ".join(p.name() + " " + " ".join(p.cmdline()) for p in out)
    assert "EngineCore" in names and "Worker" in names, names  # vLLM's engine and worker are there to be left
    # The worker, forked by our launcher (not spawned), still binds to the CPUs vLLM chose for it,
    # keeping one for the engine: unbound, its threads ran on every core (~half the tokens per second).
    (worker,) = [p for p in out if p.name().startswith("VLLM::Worker")]
    assert set(worker.cpu_affinity()) < set(psutil.Process().cpu_affinity()), worker.cpu_affinity()
    return out


@pytest.fixture
def serving(tiny_model_dir, tmp_path):
    proc, reg = start(tiny_model_dir, tmp_path)
    yield proc, reg
    if proc.poll() is None:  # the test failed before its kill: stop it (its server follows)
        proc.terminate()
        proc.wait(timeout=120)


def test_sigkill_to_apriel_serve_stops_its_server_engine_and_workers(serving):
    proc, reg = serving
    processes = family(proc)
    assert reg["pid"] != proc.pid and reg["pid"] in {p.pid for p in processes}
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert_all_exit(processes)


def test_sigkill_to_its_vllm_server_kills_what_the_server_left_and_apriel_serve_dies_alike(serving, tmp_path):
    proc, reg = serving
    processes = family(proc)
    os.kill(reg["pid"], signal.SIGKILL)
    assert proc.wait(timeout=180) == -signal.SIGKILL
    assert_all_exit(processes)
    assert "killed" in (tmp_path / "serve.log").read_text()  # the supervisor names what it killed
