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


def test_optimizer_padding_is_saved_as_zeros_and_parameters_untouched():
    """Megatron fills the gaps between parameters of a bucket with torch.empty tensors: saved as
    they were, two saves of one state differed there (by up to 1e26)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    from megatron_apriel.trainer.checkpoint import _zero_padding

    def tensor(values):
        data = torch.tensor(values, dtype=torch.float32)
        return ShardedTensor.from_rank_offsets("k", data, replica_id=0)

    pad = {"param": tensor([1e26, -3.0]), "exp_avg": tensor([7.0, 7.0]), "padding": LocalNonpersistentObject(True)}
    real = {"param": tensor([0.5, 0.25]), "exp_avg": tensor([1.0, 2.0]), "padding": LocalNonpersistentObject(False)}
    state = {0: {"param_state": {0: {torch.float32: [[real, pad]]}}}}
    _zero_padding(state)
    assert pad["param"].data.tolist() == [0.0, 0.0] and pad["exp_avg"].data.tolist() == [0.0, 0.0]
    assert real["param"].data.tolist() == [0.5, 0.25] and real["exp_avg"].data.tolist() == [1.0, 2.0]
