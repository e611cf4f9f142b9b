"""Run one command as a SLURM task so that nothing it starts outlives it.

    python -m megatron_apriel.slurm.supervise -- COMMAND [ARGS...]

A killed vLLM API server leaves its engine and worker processes behind: they are reparented to
init, where SLURM's process tracking (``proctrack/linuxproc``, and anything short of cgroups) no
longer sees them, and they hold the node's memory for the next job. This supervisor:

- makes itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): orphans of the command are
  reparented to it, not to init, so they stay descendants of the task;
- runs the command as a ``ManagedProcess`` (its own process group, SIGTERM if the supervisor
  dies), passes SIGTERM and SIGINT on to that group and ignores SIGUSR1 (a stop signal is for the
  trainer only; the command inherits the ignore);
- when the command exits, for whatever reason, kills every process still below it (by pid, from
  ``/proc``), reaps them, and exits with the command's code (128 + N for signal N).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

from megatron_apriel.process import ManagedProcess

PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def descendants(root: int) -> list[int]:
    """Pids of every live process below ``root``, from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
        state, ppid = text.rsplit(")", 1)[1].split()[:2]  # the name may hold spaces and parentheses
        if state != "Z":  # a zombie is only waiting to be reaped
            children.setdefault(int(ppid), []).append(int(stat.parent.name))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += children.get(pid, [])
    return out


def kill_below(root: int) -> list[int]:
    """SIGKILL every process below ``root`` and reap those that are its children; the pids killed."""
    killed: list[int] = []
    for _ in range(100):
        if not (pids := descendants(root)):
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass  # already gone
        _reap()
        time.sleep(0.05)
    else:
        raise RuntimeError(f"processes below {root} survive SIGKILL: {descendants(root)}")
    return killed


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def supervise(cmd: list[str], env: dict | None = None) -> int:
    """Run ``cmd`` (with ``env`` added to this process's) as described above; its exit code."""
    _become_subreaper()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    child = ManagedProcess(cmd[0], cmd, env=dict(env or {}))
    child.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.terminate(signum))
    code = child.wait()
    killed = kill_below(os.getpid())
    if killed:
        print(f"supervise: {cmd[0]} exited ({code}); killed {len(killed)} process(es) it left: {killed}",
              file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: python -m megatron_apriel.slurm.supervise -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    return supervise(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
