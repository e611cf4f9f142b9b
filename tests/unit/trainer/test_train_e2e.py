"""The self-sampling run: `apriel-train --config-name tiny_local` trains and the reward rises."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.integration  # its tests start processes of their own


OUTSIDE = ("cwd", "home", "tmp")


def scalars(run_dir: Path, key: str) -> list[float]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [e.value for e in acc.Scalars(key)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    exe = shutil.which("apriel-train")
    assert exe, "apriel-train is not on PATH: install the package with `pip install -e .[test]`"
    base = tmp_path_factory.mktemp("tiny")
    run_dir = base / "run"
    for name in OUTSIDE:  # the run's cwd, HOME and TMPDIR: empty dirs beside run_dir, checked afterwards
        (base / name).mkdir()
    env = dict(launcher_env(), HOME=str(base / "home"), TMPDIR=str(base / "tmp"))
    proc = subprocess.run([exe, "--config-name", "tiny_local", f"run_dir={run_dir}"],  # port: a free one
                          capture_output=True, text=True, timeout=600, cwd=base / "cwd", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return run_dir


def test_run_writes_only_into_its_directory(run_dir):
    base = run_dir.parent
    assert sorted(p.name for p in base.iterdir()) == sorted(("run", *OUTSIDE))
    for name in ("cwd", "home"):
        assert sorted((base / name).rglob("*")) == [], f"the run wrote into its {name}"
    # torch.distributed.run (torchelastic_*) and inductor leave empty directories in TMPDIR; no file may stay
    assert [p for p in (base / "tmp").rglob("*") if not p.is_dir()] == []
    assert (run_dir / "config.yaml").is_file()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["run_dir"] == str(run_dir)
    assert any((run_dir / "tensorboard").iterdir())


def test_reward_rises_and_policy_is_on_policy(run_dir):
    reward = scalars(run_dir, "rollout/reward")
    assert len(reward) == 30
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    assert last > first + 0.2, (first, last)
    # behaviour log-probs were recorded by the same model: the GSPO ratio is 1 up to round-off
    assert max(scalars(run_dir, "train/abs_log_ratio")) < 1e-5
    assert all(abs(r - 1) < 1e-5 for r in scalars(run_dir, "train/ratio_mean"))
