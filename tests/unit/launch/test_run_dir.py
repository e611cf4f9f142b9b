"""The run directory's layout (public contract, ../shared/ARCHITECTURE.md) comes from one object."""

from megatron_apriel.run_dir import RunDir


def test_the_layout_is_the_contracts(tmp_path):
    run = RunDir(tmp_path)
    contract = {"config.yaml": run.config, "checkpoints": run.checkpoints, "rollouts": run.rollouts,
                "fleet": run.fleet, "tensorboard": run.tensorboard, "logs": run.logs, "hf": run.hf, "base": run.base,
                "slurm": run.slurm, "logs/metrics.jsonl": run.metrics, "logs/trainer.log": run.log("trainer"),
                "tensorboard/actor": run.actor_tensorboard}
    assert {name: path.relative_to(tmp_path).as_posix() for name, path in contract.items()} == \
        {name: name for name in contract}


def test_clearing_registrations_removes_only_them(tmp_path):
    run = RunDir(tmp_path)
    run.fleet.mkdir()
    for name in ("a.json", "b.json", "notes.txt"):
        (run.fleet / name).write_text("{}")
    removed = run.clear_registrations()
    assert [p.name for p in removed] == ["a.json", "b.json"]
    assert [p.name for p in run.fleet.iterdir()] == ["notes.txt"]
    assert run.clear_registrations() == []  # nothing left to clear; a missing fleet/ is fine too
    assert RunDir(tmp_path / "elsewhere").clear_registrations() == []
