"""One resolved config per run: the launcher composes once and writes ``run_dir/config.yaml``; every
other process reads it back; a relaunch reads it again instead of the preset files."""

import shutil
from pathlib import Path

import pytest

from megatron_apriel.config import launch_config, load_run_config, save_run_config
from megatron_apriel.launch.components import components

FIVE = "actor.data=[/d.jsonl]"


def preset_dir(tmp_path: Path, steps: int) -> Path:
    d = tmp_path / "presets"
    d.mkdir(exist_ok=True)
    (d / "mine.yaml").write_text(f"defaults: [tiny_cpu, _self_]\ntrainer:\n  steps: {steps}\n")
    return d


@pytest.mark.parametrize("name, extra", [("tiny_cpu", []), ("tiny_moe_cpu", []), ("tiny_local", []),
                                         ("apriel_15b", ["model.hf_path=/m", FIVE]),
                                         ("qwen3_30b_a3b", ["model.hf_path=/m", FIVE])])
def test_what_is_saved_reads_back_as_the_same_typed_run(tmp_path, name, extra):
    run, relaunch = launch_config(name, [f"run_dir={tmp_path / 'run'}", *extra])
    assert not relaunch
    save_run_config(run)
    assert load_run_config(tmp_path / "run") == run


def test_a_relaunch_reads_the_saved_config_not_the_preset_and_applies_its_overrides(tmp_path):
    args = [f"run_dir={tmp_path / 'run'}", "seed=7"]
    first, _ = launch_config("mine", args, str(preset_dir(tmp_path, steps=5)))
    save_run_config(first)
    preset_dir(tmp_path, steps=50)  # the preset file changes between the launch and the relaunch
    again, relaunch = launch_config("mine", args, str(tmp_path / "presets"))
    assert relaunch and again == first and again.trainer.steps == 5
    changed, _ = launch_config("mine", [*args, "trainer.steps=8"], str(tmp_path / "presets"))
    assert changed.trainer.steps == 8 and changed.seed == 7


def test_the_same_command_again_is_the_same_run_also_with_additions(tmp_path):
    """A requeued SLURM attempt passes the job's arguments again: ``+key`` must not fail on a key
    the saved config holds already."""
    args = [f"run_dir={tmp_path / 'run'}", "+actor.sampler.weights.code=0.3", "trainer.steps=3"]
    first, _ = launch_config("tiny_cpu", args)
    save_run_config(first)
    again, relaunch = launch_config("tiny_cpu", args)
    assert relaunch and again == first and again.actor.sampler.weights == {"math": 1.0, "code": 0.3}


def test_a_copied_run_directory_reads_as_itself(tmp_path):
    run, _ = launch_config("tiny_cpu", [f"run_dir={tmp_path / 'run'}"])
    save_run_config(run)
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    copy = load_run_config(tmp_path / "copy")
    assert copy.run_dir == str(tmp_path / "copy") and copy.model.hf_path == str(tmp_path / "copy" / "base")
    relaunched, relaunch = launch_config("tiny_cpu", [f"run_dir={tmp_path / 'copy'}"])
    assert relaunch and relaunched == copy


def test_a_missing_or_bad_saved_config_is_refused_saying_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="start the run with apriel-train"):
        load_run_config(tmp_path / "nothing")
    run, _ = launch_config("tiny_cpu", [f"run_dir={tmp_path / 'run'}"])
    path = save_run_config(run)
    path.write_text(path.read_text().replace("seed: 1234", "seed: 1234\nsede: 1"))
    with pytest.raises(ValueError, match="sede"):
        load_run_config(tmp_path / "run")


def test_the_components_read_the_run_directory_not_the_command_line(tmp_path):
    run, _ = launch_config("tiny_cpu", [f"run_dir={tmp_path / 'run'}", "trainer.steps=3"])
    by_name = {c.name: c.cmd for c in components(run)}
    for name in ("actor", "trainer"):
        cmd = by_name[name]
        assert cmd[-2:] == ["--run-dir", run.run_dir], cmd
        assert not any("=" in a for a in cmd[cmd.index("--run-dir") - 1:]), cmd  # no override passed on
    assert "megatron_apriel.entrypoints.trainer_rank" in by_name["trainer"]


def test_apriel_train_is_the_launcher_only(tmp_path):
    import os
    import subprocess

    env = {**os.environ, "RANK": "0"}  # what torchrun sets: the old way to run a trainer rank
    proc = subprocess.run([shutil.which("apriel-train"), f"run_dir={tmp_path / 'run'}"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("apriel-train: error: trainer ranks no longer run this command")
    assert "megatron_apriel.entrypoints.trainer_rank --run-dir RUN_DIR" in proc.stderr
    assert not (tmp_path / "run").exists()
