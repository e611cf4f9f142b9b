"""`ManagedProcess.stop` returns only once every process it started has exited, so what they held
(a vLLM server's GPU memory) is free for the restarted one; a grandchild that left the group and
ignores SIGTERM is killed and waited for too."""

import sys
import time

import psutil

from megatron_apriel.process import ManagedProcess

# The child starts a grandchild in a session of its own (outside the child's process group) that
# ignores SIGTERM and would live for minutes, writes its pid to the file named by argv[1], then waits.
FAMILY = """
import os, subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "time.sleep(600)"], start_new_session=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(g.pid))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def test_stop_returns_once_every_descendant_is_gone(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    proc = ManagedProcess("family", [sys.executable, "-c", FAMILY, str(pid_file)], tmp_path / "family.log")
    proc.start()
    while not pid_file.exists():
        assert proc.poll() is None, (tmp_path / "family.log").read_text()
        time.sleep(0.01)
    grandchild = psutil.Process(int(pid_file.read_text()))
    proc.poll()  # notes the family while it runs
    proc.stop(grace_s=5)
    gone = not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE
    assert gone, "stop returned while the grandchild still ran"
