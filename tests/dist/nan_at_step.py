"""A trainer rank whose batch of one step has a NaN behaviour log-prob (fault injection for
tests/unit/trainer/test_nonfinite.py; production code has no switch for it):

    torchrun --nproc_per_node 2 tests/dist/nan_at_step.py STEP --run-dir RUN_DIR

The rest is the real ``megatron_apriel.entrypoints.trainer_rank`` (it reads the arguments after STEP).
Everything happens under ``__main__``: the trainer's spawned helper processes import this file too.
"""

import sys


def poison_step(step: int) -> None:
    from megatron_apriel.trainer import trainer

    train_once = trainer.Trainer.train_once

    def poisoned(self, samples):
        if self.step == step and samples:
            samples[0].behaviour_logprobs[0] = float("nan")  # so the step's loss is NaN
        return train_once(self, samples)

    trainer.Trainer.train_once = poisoned


if __name__ == "__main__":
    poison_step(int(sys.argv.pop(1)))
    from megatron_apriel.entrypoints.trainer_rank import main

    main()
