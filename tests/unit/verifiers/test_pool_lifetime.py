"""The verifier pool's lifetime is its owner's. Nothing of it outlives an owner killed by SIGKILL
(as an OOM kill or ``kill -9`` of the actor or apriel-eval): workers and resource tracker all exit.
Before, a forkserver, its workers and the tracker stayed, reparented to init, ~1 GB for good. And a
SIGTERM to the owner's whole process group (how the launcher and SLURM stop the actor) leaves the
workers to the owner: its verifications finish, no BrokenProcessPool."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration  # its tests start processes of their own

OWNER = """
import os, sys
from megatron_apriel.verifiers import make_verifier_pool
if __name__ == "__main__":
    pool = make_verifier_pool(2)
    assert pool.submit(sum, [1, 2]).result() == 3 and pool.submit(sum, [3]).result() == 3  # workers up
    print(os.getpid(), flush=True)
    sys.stdin.read()  # until killed
"""


def test_the_verifier_pool_dies_with_its_owner(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[3], start_new_session=True)
    try:
        pid = int(owner.stdout.readline())
        family = psutil.Process(pid).children(recursive=True)
        kinds = sorted(" ".join(p.cmdline()).split("import ")[-1].split(";")[0] for p in family)
        assert len(family) >= 2, kinds  # the resource tracker and at least one worker
        os.kill(pid, signal.SIGKILL)
        owner.wait(30)
        deadline = time.monotonic() + 60
        while alive := [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
            assert time.monotonic() < deadline, \
                f"left running after the owner's SIGKILL: {[p.cmdline() for p in alive]}"
            time.sleep(0.1)
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)


STOPPED_BY_ITS_GROUP = """
import os, signal, sys
from megatron_apriel.verifiers import make_verifier_pool
if __name__ == "__main__":
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    with make_verifier_pool(2) as pool:
        assert pool.submit(sum, [1]).result() == 1  # a worker is up
        os.killpg(0, signal.SIGTERM)  # the launcher's way: the owner and every worker
        while not stop:
            signal.pause()
        print(pool.submit(sum, [2, 3]).result(), flush=True)  # the pool still works while the owner stops
"""


def test_a_sigterm_to_the_owners_group_leaves_the_pool_to_the_owner(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(STOPPED_BY_ITS_GROUP)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3], start_new_session=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "5", proc.stderr[-3000:]
