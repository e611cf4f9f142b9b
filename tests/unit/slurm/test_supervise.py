"""The SLURM task supervisor: nothing the command started outlives it, signals reach the command."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # its tests start processes of their own

SUPERVISE = [sys.executable, "-m", "megatron_apriel.slurm.supervise", "--"]


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_an_orphan_in_another_session_is_killed_when_the_command_exits(tmp_path):
    """What a killed vLLM API server leaves: a process outside its group, reparented away from it."""
    pidfile = tmp_path / "orphan.pid"
    proc = subprocess.run([*SUPERVISE, "bash", "-c", f"setsid sleep 300 >/dev/null 2>&1 & echo $! > {pidfile}; exit 3"],
                          capture_output=True, text=True, timeout=60)
    orphan = int(pidfile.read_text())
    assert proc.returncode == 3
    if alive(orphan):
        os.kill(orphan, signal.SIGKILL)  # by its pid: this test's own process
        raise AssertionError("the orphan outlived the supervised command")
    assert f"killed 1 process(es) it left: [{orphan}]" in proc.stderr


def test_sigterm_reaches_the_command_and_its_code_is_returned(tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen([*SUPERVISE, "bash", "-c", f'trap "exit 7" TERM; touch {ready}; sleep 100 & wait'])
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, "the command did not start"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGUSR1)  # ignored: a stop signal is for the trainer only
    time.sleep(0.3)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 7


def test_the_supervisor_ends_as_its_command_did():
    """Killed by the same signal (whoever waits on the supervisor sees what happened), or its code."""
    killed = subprocess.run([*SUPERVISE, "bash", "-c", "kill -9 $$"], timeout=60)
    assert killed.returncode == -signal.SIGKILL
    terminated = subprocess.run([*SUPERVISE, "bash", "-c", "kill -TERM $$"], timeout=60)
    assert terminated.returncode == -signal.SIGTERM
    assert subprocess.run([*SUPERVISE, "bash", "-c", "exit 5"], timeout=60).returncode == 5


OUTLIVES_SIGKILL = """
import json, subprocess
from megatron_apriel import process
child = subprocess.Popen(["sleep", "300"])
process.descendants = lambda root: [child.pid]  # listed for good, as a process stuck in uninterruptible sleep is
print(json.dumps(process.kill_below(child.pid, timeout_s=0.5)))
"""


def test_a_process_that_outlives_sigkill_is_named_not_raised():
    """On a busy machine a SIGKILLed vLLM engine outlived the 5 s the supervisor used to give it: the
    supervisor raised, apriel-serve exited 1 instead of -9, and the launcher misreported the server's
    death. Now it waits (60 s by default), then names what is left and returns."""
    proc = subprocess.run([sys.executable, "-c", OUTLIVES_SIGKILL], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [pid] = json.loads(proc.stdout)
    assert f"still there 0.5s after SIGKILL (uninterruptible sleep?): [{pid}]" in proc.stderr


LEAKER = """
import multiprocessing as mp, os, signal, sys, time
from multiprocessing import shared_memory

def hold(path):
    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    open(path, "w").write(shm.name)
    time.sleep(300)

if __name__ == "__main__":
    child = mp.get_context("spawn").Process(target=hold, args=(sys.argv[1],))
    child.start()
    while not os.path.exists(sys.argv[1]) or not open(sys.argv[1]).read():
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)  # as a SIGKILLed vLLM server: its child is left holding the memory
"""


def test_shared_memory_left_by_a_killed_command_is_unlinked(tmp_path):
    """The orphan is killed, and its resource tracker, left to exit by itself, unlinks its segment."""
    script, name_file = tmp_path / "leaker.py", tmp_path / "shm.name"
    script.write_text(LEAKER)
    proc = subprocess.run([*SUPERVISE, sys.executable, str(script), str(name_file)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    segment = Path("/dev/shm") / name_file.read_text()
    if segment.exists():
        segment.unlink()
        raise AssertionError(f"{segment} outlived the supervised command: {proc.stderr}")
