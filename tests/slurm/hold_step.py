"""``python -m tests.slurm.hold_step ARGS``: a trainer rank (``megatron_apriel.entrypoints.trainer_rank
ARGS``) that, in a run starting from scratch, holds after its first step until a stop request
reaches it (SLURM's time-limit warning, relayed by the batch shell), then goes on, and so stops
between steps 1 and 2. Every rank holds (each waits for its own signal), so no rank runs ahead
into a collective. A resumed run is not held. So the warning is certain to land mid-run however
long SLURM takes to send it, without steps to fill the wait. Started by tests/slurm/hold_python.sh
(``step.arm``)."""

import runpy
import sys
import time

HOLD_LIMIT_S = 300.0
"""A hold that no stop request ends lets the run go on after this long (the test then fails on its own)."""


def hold_after_first_step() -> None:
    from megatron_apriel.trainer.trainer import Trainer

    restore, step = Trainer.restore, Trainer._step

    def restore_and_note(self):
        restore(self)
        self._hold_test_fresh = self.step == 0

    def held_step(self):
        metrics, stop = step(self)  # step 0's metrics are logged and its weights pushed by now
        if getattr(self, "_hold_test_fresh", False) and self.step == 1 and not stop:
            t0 = time.monotonic()
            while not self.stop.requested and time.monotonic() - t0 < HOLD_LIMIT_S:
                time.sleep(0.05)
        return metrics, stop

    Trainer.restore, Trainer._step = restore_and_note, held_step


if __name__ == "__main__":
    hold_after_first_step()
    sys.argv = ["megatron_apriel.entrypoints.trainer_rank", *sys.argv[1:]]
    runpy.run_module("megatron_apriel.entrypoints.trainer_rank", run_name="__main__", alter_sys=True)
