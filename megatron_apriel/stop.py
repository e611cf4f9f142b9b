"""Stop requests to a trainer rank, and the exception that ends a wait because of one.

A stop request comes as a signal or as a file:

- SIGTERM: ``scancel``, SLURM's time limit or preemption (to every process of the job), the
  local launcher stopping the run, or the SLURM job script stopping the trainer after another
  component failed;
- SIGUSR1: ``scancel --signal=USR1 JOB`` (to every step), the stop signal users send by hand;
- the stop file (``APRIEL_STOP_FILE``, set by ``slurm/train.sbatch``): how the job script passes
  on SLURM's time-limit warning (``--signal=B:USR1@T``, which reaches only the batch shell). A
  file, not a signal, because the warning may come before the trainer has started: a signal sent
  then would find no handler (and kill the rank), a file is still there when the trainer looks.

Either way the trainer finishes what it is doing (a step, a save), saves, and exits 0; every
rank acts together (``any_rank``), so one rank's signal is enough. Standard library only.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_FILE_ENV = "APRIEL_STOP_FILE"
STOP_COST_FILE = "stop_seconds"
"""In each checkpoint directory (``checkpoints/step_N/``): the seconds the trainer needs to stop
(finish a step, save), as it measured them up to that save; ``slurm/train.sbatch`` gives it at
least that long (from the newest checkpoint), ``apriel-submit`` compares it with SLURM's KillWait
and ``slurm.signal_s``."""


class StopRequested(Exception):
    """Raised on every rank at once when a stop request ends a wait (for rollouts, for the fleet)."""


class StopFlag:
    """Set by a stop signal (handlers installed by the constructor) or by the stop file existing.

    Create it first thing in a trainer rank, before anything slow: a signal that comes while the
    model is built is remembered, not fatal.
    """

    def __init__(self, file: Optional[str] = None):
        self.file = Path(file) if file else None
        self.signal: Optional[str] = None
        """The name of the first stop signal received, or None."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal is not None or (self.file is not None and self.file.exists())

    def reason(self) -> str:
        if self.signal is not None:
            return self.signal
        return f"stop file {self.file}" if self.requested else "none"
