"""Checkpoint housekeeping in a real run: keep_last pruning and leftover ``.tmp`` directories."""

import shutil
import subprocess

import pytest

from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.trainer.checkpoint import latest_checkpoint
from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.integration  # its tests start processes of their own


def test_keep_last_prunes_old_checkpoints_and_leftover_tmp_dirs_do_not_count(tmp_path):
    """Four steps saved every step with keep_last=2, over a run directory holding a crashed save of
    step 3 (with a stray file) and one of a later step 9: steps 3 and 4 remain, step 3 is a fresh
    save, and the step-9 leftover is neither resumed nor counted as one of the kept checkpoints."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    (ckpts / "step_00000003.tmp" / "dist").mkdir(parents=True)
    (ckpts / "step_00000003.tmp" / "stray").write_text("from a crashed save")
    (ckpts / "step_00000009.tmp" / "dist").mkdir(parents=True)
    cmd = [shutil.which("apriel-train"), "--config-name", "tiny_local", f"run_dir={run}", "trainer.steps=4",
           "checkpoint.save_every=1", "checkpoint.keep_last=2", f"launch.master_port={free_port()}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=launcher_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "resumed" not in proc.stdout + proc.stderr  # a .tmp is never a checkpoint to resume
    complete = sorted(p.name for p in ckpts.glob("step_*") if not p.name.endswith(".tmp"))
    assert complete == ["step_00000003", "step_00000004"]
    assert not (ckpts / "step_00000003" / "stray").exists()
    assert (ckpts / "step_00000003" / "state.json").is_file()
    assert latest_checkpoint(ckpts) == ckpts / "step_00000004"
