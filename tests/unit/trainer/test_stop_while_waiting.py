"""A stop signal while the trainer waits for rollouts (the actor gone: the step would never fill)
is acted on at once: the last completed step is saved and ``run`` returns, no partial step trained.

One process, the real trainer (``build_trainer``) on the stream source; no fleet (no weight sender).
"""

import os
import signal
import threading
import time

import pytest
from hydra import compose, initialize_config_module

from megatron_apriel.config import register_configs, to_run_config
from megatron_apriel.entrypoints import trainer_rank as train_entry
from megatron_apriel.parallel.rendezvous import single_process_world
from megatron_apriel.records.stream import StreamWriter
from megatron_apriel.stop import STOP_SIGNALS
from megatron_apriel.tiny.model import build_tiny_model
from megatron_apriel.trainer.checkpoint import latest_checkpoint
from tests.unit.records.test_stream import group, snap

register_configs()


def _append_groups(writer: StreamWriter, n: int) -> None:
    groups = [group(3 + writer.next_seq + k) for k in range(n)]
    writer.append(groups, snap(writer.next_seq + n))


@pytest.fixture
def saved_handlers():
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_a_stop_signal_while_waiting_for_rollouts_saves_the_last_step_and_returns(tmp_path, monkeypatch,
                                                                                  saved_handlers):
    base = build_tiny_model(tmp_path / "base")  # what the fleet would serve; the trainer starts from it
    with initialize_config_module(config_module="megatron_apriel.conf", version_base=None):
        cfg = compose(config_name="tiny_local", overrides=[
            f"run_dir={tmp_path}", "rollout.source=fleet", f"model.hf_path={base}", "rollout.groups_per_step=1",
            "rollout.group_size=2", "trainer.steps=2", "checkpoint.save_every=0", "launch.nproc_per_node=1",
            "actor.max_prompt_tokens=16"])
    run = to_run_config(cfg)
    monkeypatch.setattr(train_entry, "build_sender", lambda *args: None)  # no fleet: nothing to push to
    writer = StreamWriter(tmp_path / "rollouts")
    _append_groups(writer, 1)  # step 0's rollouts; step 1's never come (the actor is gone)
    outcome: dict = {}

    with single_process_world() as ctx:
        trainer = train_entry.build_trainer(run, ctx)

        def signal_then_valve() -> None:
            while trainer.step < 1:
                time.sleep(0.05)
            time.sleep(1.0)  # the trainer is now polling for step 1
            outcome["signalled_at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            if "returned_at" not in outcome:  # ignored: let step 1 fill so the test fails instead of hanging
                _append_groups(writer, 1)

        threading.Thread(target=signal_then_valve, daemon=True).start()
        history = trainer.run()
        outcome["returned_at"] = time.monotonic()
        trainer.close()

    assert len(history) == 1 and trainer.step == 1  # step 1 was not trained from a partial batch
    assert outcome["returned_at"] - outcome["signalled_at"] < 20
    latest = latest_checkpoint(tmp_path / "checkpoints")
    assert latest is not None and latest.name == "step_00000001"  # saved although save_every=0
