"""Run one command as a SLURM task so that nothing it starts outlives it.

    python -m megatron_apriel.slurm.supervise -- COMMAND [ARGS...]

A killed process's orphans (a vLLM engine, verifier workers) are reparented to init, where
SLURM's process tracking (``proctrack/linuxproc``, and anything short of cgroups) no longer sees
them, and they hold the node's memory for the next job. This runs the command under
``process.supervise`` (a child subreaper that kills what the command leaves when it exits) and
ignores SIGUSR1, a stop signal meant for the trainer only (the command inherits the ignore). It
ends as the command ended: with its exit code, or killed by the same signal.
"""

from __future__ import annotations

import signal
import sys

from megatron_apriel.process import exit_like, supervise


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: python -m megatron_apriel.slurm.supervise -- COMMAND [ARGS...]", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    exit_like(supervise(argv[1:]))


if __name__ == "__main__":
    main()
