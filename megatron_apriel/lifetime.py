"""Processes that die with their parent (Linux ``prctl(PR_SET_PDEATHSIG)``). Standard library only.

Used where a parent may be killed without a chance to stop its children (SIGKILL, the OOM killer):
the local launcher's components, the verifier pool's workers and the trainer's checkpoint-writer
helper.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits. Call in the
    child (a ``preexec_fn`` or a pool initializer). If the parent is already gone, exit at once."""
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent == 1:  # reparented before the call: the parent died in between
        os._exit(1)
