"""Run one tool call in a forked child, with a wall-clock limit that holds even when the call
never gives the interpreter back (``MathAPI.power(base=7, exponent=10**8)`` spends minutes inside
one C-level ``**``, holding the GIL: a thread's timeout could not even fire).

    outcome = run_forked(lambda: call_and_return_new_state(), timeout_s=10, memory_mb=1024)

The child runs ``fn``, sends back ``pickle.dumps(fn())`` through a pipe and exits; the parent
waits at most ``timeout_s`` and then kills it (SIGKILL). What ``fn`` changed in the child's memory
is lost: a caller that wants a tool's new state returns it from ``fn`` (the tool instance
itself) and keeps that copy. So a call that times out or crashes leaves the caller's state as
it was before the call.

Limits in the child: RLIMIT_AS (its address space may grow by ``memory_mb``), RLIMIT_CPU (the
timeout, rounded up, plus one second) and death with its parent (PR_SET_PDEATHSIG), so a killed
owner leaves no runaway child. This is isolation of time and memory, not a sandbox: ``fn`` runs
our own code (a dispatch to a tool method with literal arguments; ``calls.py``), never model text.

Traps for the caller: ``fork`` copies only the calling thread, so call it from a process whose
other threads hold no lock that the child needs (our verifier workers are single-threaded); and
no other code of the process may reap children with ``waitpid(-1)``.
"""

from __future__ import annotations

import math
import os
import pickle
import resource
import select
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

from megatron_apriel.lifetime import die_with_parent


@dataclass(frozen=True)
class Forked:
    """The outcome of ``run_forked``: ``value`` when ``ok``, else ``error`` says why not."""

    ok: bool
    value: Any = None
    error: str = ""
    timed_out: bool = False


def run_forked(fn: Callable[[], Any], *, timeout_s: float, memory_mb: int) -> Forked:
    """``fn()`` in a forked child within ``timeout_s`` seconds (module docstring)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(fn, read_fd, write_fd, timeout_s, memory_mb)  # never returns
    os.close(write_fd)
    try:
        data, timed_out = _read_until(read_fd, time.monotonic() + timeout_s)
    finally:
        os.close(read_fd)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return Forked(False, error=f"the call timed out after {timeout_s:g} s", timed_out=True)
    if not data:
        return Forked(False, error=f"the call's process died ({_status_text(status)})")
    kind, value = pickle.loads(data)
    return Forked(True, value=value) if kind == "ok" else Forked(False, error=value)


def _child(fn: Callable[[], Any], read_fd: int, write_fd: int, timeout_s: float, memory_mb: int) -> None:
    """In the child: limits, ``fn()``, its pickle to the pipe, ``os._exit`` whatever happens."""
    code = 1
    try:
        os.close(read_fd)
        die_with_parent(signal.SIGKILL)
        _limit(timeout_s, memory_mb)
        try:
            payload = pickle.dumps(("ok", fn()), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as err:  # reported to the parent, which decides what it means
            payload = pickle.dumps(("raised", f"{type(err).__name__}: {err}"[:2000]))
        view = memoryview(payload)
        while view:
            view = view[os.write(write_fd, view):]
        code = 0
    finally:
        os._exit(code)  # never return into the parent's code, never run its atexit handlers


def _limit(timeout_s: float, memory_mb: int) -> None:
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = current + (memory_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    cpu = math.ceil(timeout_s) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu if hard == resource.RLIM_INFINITY else min(cpu, hard), hard))


def _read_until(fd: int, deadline: float) -> tuple[bytes, bool]:
    """Everything written to ``fd`` until EOF, or (what came, True) at ``deadline``."""
    poller = select.poll()  # poll, not select: a busy process may hold descriptors above 1024
    poller.register(fd, select.POLLIN | select.POLLHUP)
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), True
        if not poller.poll(left * 1000):
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"
