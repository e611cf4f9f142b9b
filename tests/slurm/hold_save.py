"""``python -m tests.slurm.hold_save ARGS``: a trainer rank (``megatron_apriel.entrypoints.trainer_rank
ARGS``) whose first checkpoint save is held inside Megatron's first forked file writer until that
writer itself receives SIGTERM (as every process of the step does on ``scancel``), then goes on.
So the signal is certain to arrive mid-save, with the writers and Megatron's helpers running.
Started by tests/slurm/hold_python.sh; writes ``$APRIEL_TEST_HOLDS/save.held`` when it holds."""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

HOLD_LIMIT_S = 300.0
"""A hold that no SIGTERM ends lets the save go on after this long (the test then fails on its own)."""


def hold_first_writer(held: Path) -> None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data

    def held_writer(*args, **kwargs):
        if not held.exists():  # a forked writer: the first one of the first save holds
            got = []
            signal.signal(signal.SIGTERM, lambda *a: got.append(a[0]))
            held.write_text(str(os.getpid()))
            t0 = time.monotonic()
            while not got and time.monotonic() - t0 < HOLD_LIMIT_S:
                time.sleep(0.05)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(held_writer)


if __name__ == "__main__":
    hold_first_writer(Path(os.environ["APRIEL_TEST_HOLDS"]) / "save.held")
    sys.argv = ["megatron_apriel.entrypoints.trainer_rank", *sys.argv[1:]]
    runpy.run_module("megatron_apriel.entrypoints.trainer_rank", run_name="__main__", alter_sys=True)
