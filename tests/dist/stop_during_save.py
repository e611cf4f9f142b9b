"""SIGTERM and SIGUSR1 sent to every process of a trainer rank in the middle of a checkpoint save,
as ``scancel`` and SLURM's time limit do to a job step: the save completes, the request is acted
on (the run stops after that step), and the checkpoint resumes.

Run by tests/unit/trainer/test_stop_during_save.py as ``python stop_during_save.py RUN_DIR OUT.json`` in
a fresh interpreter: Megatron's checkpoint helpers live once per process, and the order of
start-up is what is tested (``run_trainer``'s: the stop flag, then ``shield_checkpoint_writer``).
The signals come from inside the save: the first of Megatron's forked file writers sends them to
its parent (the rank) and to every other child of it (the results manager, the resource tracker,
the other writers), then writes its file.
"""

import json
import os
import signal
import sys
from pathlib import Path

import psutil


def signal_the_rank_once(marker: Path):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    write = FileSystemWriterAsync.write_preloaded_data

    def writer_that_signals(*args, **kwargs):
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            rank = psutil.Process(os.getppid())
            for proc in [rank, *rank.children()]:
                if proc.pid != os.getpid():
                    proc.send_signal(signal.SIGTERM)
                    proc.send_signal(signal.SIGUSR1)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(writer_that_signals)


def main() -> None:
    from hydra import compose, initialize_config_module

    from megatron_apriel._patches import shield_checkpoint_writer
    from megatron_apriel.config import register_configs, to_run_config
    from megatron_apriel.entrypoints.trainer_rank import build_trainer
    from megatron_apriel.parallel.rendezvous import single_process_world
    from megatron_apriel.stop import StopFlag
    from megatron_apriel.trainer.checkpoint import latest_checkpoint

    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    stop = StopFlag()
    shield_checkpoint_writer()
    register_configs()
    with initialize_config_module(config_module="megatron_apriel.conf", version_base=None):
        cfg = compose(config_name="tiny_local", overrides=[
            f"run_dir={run_dir}", "trainer.steps=4", "checkpoint.save_every=1", "launch.nproc_per_node=1",
            "rollout.groups_per_step=2", "rollout.group_size=2"])
    run = to_run_config(cfg)
    marker = run_dir / "signalled_by_writer"
    with single_process_world() as ctx:
        trainer = build_trainer(run, ctx, stop)
        helpers = psutil.Process().children()
        signal_the_rank_once(marker)
        history = trainer.run()
        result = {"steps_run": len(history), "step": trainer.step, "signal": stop.signal,
                  "writer_signalled": marker.exists(),
                  "helpers_alive": [p.is_running() for p in helpers],
                  "latest": latest_checkpoint(run_dir / "checkpoints").name,
                  "left_tmp": sorted(p.name for p in (run_dir / "checkpoints").glob("*.tmp")),
                  "stop_seconds": (run_dir / "checkpoints" / "step_00000001" / "stop_seconds").read_text(),
                  "train_s": history[0]["time/train_s"]}
        trainer.close()
        resumed = build_trainer(run, ctx, StopFlag())  # the checkpoint saved under the signals loads
        result["resumed_step"] = resumed.step
        resumed.close()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
