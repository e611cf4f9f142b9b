"""One way to run a child process that must not outlive its owner.

    server = ManagedProcess("server_0", cmd, log_path=RunDir(run_dir).log("server_0"))
    server.start()
    ...
    server.terminate()          # SIGTERM to its group, at once (several stop together)
    server.stop(grace_s=30)     # wait, SIGKILL what is left, then every descendant that escaped

The command runs in a session (process group) of its own, so a signal meant for the owner's
group (Ctrl-C, a launcher's SIGTERM) does not reach it unasked, and its whole group can be
signalled without touching the owner. It gets ``death_signal`` if its owner dies, even by
SIGKILL (``prctl(PR_SET_PDEATHSIG)``). Stopping kills its group and then each descendant seen
while it ran that left the group: torchrun starts each rank in a session of its own, and a
killed vLLM API server leaves its engine and workers behind. Used by the local launcher, the
SLURM supervisor and ``apriel-eval``'s servers.

``supervise(cmd)`` runs one command so that nothing it starts outlives it, even when the command
(or the supervisor) is killed: ``apriel-serve`` runs vLLM under it, the SLURM job its actor.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from megatron_apriel.lifetime import die_with_parent


@dataclass
class ManagedProcess:
    name: str
    cmd: list[str]
    log_path: Optional[Path] = None
    """Where its stdout and stderr are appended (a header line per start); None: the owner's."""
    env: dict = field(default_factory=dict)
    """Added to the owner's environment."""
    death_signal: int = signal.SIGTERM
    """Sent to it when its owner dies."""
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)
    _family: list = field(default_factory=list, repr=False)

    def start(self) -> None:
        self._family = []
        sig = self.death_signal
        kwargs = dict(start_new_session=True, env={**os.environ, **self.env}, preexec_fn=lambda: die_with_parent(sig))
        if self.log_path is None:
            self.proc = subprocess.Popen(self.cmd, **kwargs)
            return
        self.log_path = Path(self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.cmd)}\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, **kwargs)

    @property
    def pid(self) -> Optional[int]:
        return None if self.proc is None else self.proc.pid

    def poll(self) -> Optional[int]:
        """Its exit code, None while it runs; while it runs, its descendants are noted, so that
        those it leaves behind when it dies are still found by ``stop``."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            self._remember_family()
        return code

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout_s: Optional[float] = None) -> int:
        return self.proc.wait(timeout_s)

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """``sig`` to its process group, without waiting (``stop`` waits)."""
        if not self.running():
            return
        self._remember_family()
        _signal_group(self.proc.pid, sig)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to its group, SIGKILL after ``grace_s``; then the rest of the group and every
        descendant seen that left it are killed."""
        if self.proc is None:
            return
        self._remember_family()
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(grace_s)
        _signal_group(self.proc.pid, signal.SIGKILL)  # what the group still holds: usually nothing
        for p in self._family:
            try:
                p.kill()  # psutil checks it is the same process (pid and start time)
            except psutil.NoSuchProcess:
                pass  # it exited with its parent: the usual case
        self._wait_family_gone(grace_s)

    def _wait_family_gone(self, timeout_s: float) -> None:
        """Return once every descendant seen has exited (a zombie holds no memory): what they held,
        GPU memory included, is free when ``stop`` returns, so a restart on the same GPUs finds
        it free. A descendant still alive after ``timeout_s`` is named in the error."""
        deadline = time.monotonic() + timeout_s
        while alive := [p for p in self._family if _alive(p)]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: processes {[p.pid for p in alive]} still run {timeout_s}s after "
                                   "SIGKILL (stuck in the kernel, e.g. a GPU driver call?)")
            time.sleep(0.05)

    def tail(self, lines: int = 30) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])

    def _remember_family(self) -> None:
        known = {p.pid: p for p in self._family}
        try:
            known.update({p.pid: p for p in psutil.Process(self.proc.pid).children(recursive=True)})
        except psutil.NoSuchProcess:
            pass  # it has exited: its descendants were remembered while it ran, if it had any
        self._family = list(known.values())


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # no process of the group is left


# --- supervise: one command, nothing it starts outlives it ----------------------------------------

PR_SET_CHILD_SUBREAPER = 36


def supervise(cmd: list[str], env: dict | None = None, *, name: str = "") -> int:
    """Run ``cmd`` (``env`` added to this process's environment) until it exits; its exit code
    (negative: killed by that signal). What it leaves is killed, whatever ended it:

    - this process becomes a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): orphans of the
      command are reparented here, not to init, so they stay below it (a killed vLLM API server's
      engine and workers);
    - the command runs as a ``ManagedProcess`` (its own process group; SIGTERM if this process
      dies, even by SIGKILL); SIGTERM and SIGINT sent here are passed on to its group;
    - when the command exits, every process still below this one is killed (by pid, from /proc)
      and reaped; Python's resource trackers last, given ``TRACKER_GRACE_S`` to exit by themselves
      first, so that they unlink the shared memory the killed processes leaked (a vLLM server
      killed by SIGKILL otherwise leaves its message queues in /dev/shm).
    Signals this process ignores (SIG_IGN) stay ignored in the command."""
    _become_subreaper()
    name = name or os.path.basename(cmd[0])
    child = ManagedProcess(name, cmd, env=dict(env or {}))
    child.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.terminate(signum))
    code = child.wait()
    killed = kill_below(os.getpid(), spare=_is_resource_tracker)
    _wait_gone(descendants(os.getpid()), TRACKER_GRACE_S)  # the trackers clean up what the killed left
    killed += kill_below(os.getpid())
    if killed:
        print(f"supervise: {name} exited ({code}); killed {len(killed)} process(es) it left: {killed}",
              file=sys.stderr, flush=True)
    return code


def exit_like(code: int) -> None:
    """End this process as a supervised command ended: with its exit code, or killed by the same
    signal, so that whoever waits on the supervisor sees what happened to the command."""
    if code >= 0:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    if -code not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
    sys.exit(128 - code)  # a signal whose default is not to end the process (SIGCHLD, SIGSTOP...)


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


TRACKER_GRACE_S = 10.0
"""How long ``supervise`` lets Python's resource trackers, once the processes they served are killed,
unlink the shared memory and semaphores those left (vLLM's message queues in /dev/shm)."""


def kill_below(root: int, timeout_s: float = 60.0, spare=None) -> list[int]:
    """SIGKILL every process below ``root`` (but those for which ``spare(pid)`` is true), reap those
    that are its children, and wait until none is left; the pids killed. A SIGKILLed process is
    gone only once the kernel has torn it down: on a busy machine that takes seconds for a large
    one (a vLLM engine), so this waits for it. What is still there after ``timeout_s`` (stuck in
    uninterruptible sleep) is named on stderr, not raised: a supervisor must still end as its
    command did."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while pids := [pid for pid in _live_below(root) if spare is None or not spare(pid)]:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # already gone
            if pid not in killed:
                killed.append(pid)
        if time.monotonic() >= deadline:
            print(f"supervise: process(es) below {root} still there {timeout_s:g}s after SIGKILL (uninterruptible "
                  f"sleep?): {pids}", file=sys.stderr, flush=True)
            break
        time.sleep(0.05)
    return killed


def _is_resource_tracker(pid: int) -> bool:
    """Whether ``pid`` is a Python multiprocessing resource tracker: it exits by itself once every
    process it served is gone, unlinking the shared memory and semaphores they leaked."""
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` until none of ``pids`` is alive (reaping our children)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and set(pids) & set(_live_below(os.getpid())):
        time.sleep(0.05)


def _live_below(root: int) -> list[int]:
    _reap()
    return descendants(root)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
