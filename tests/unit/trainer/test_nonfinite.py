"""A NaN in one step's loss stops the run before the update, naming the step and its groups, and
leaves the last good checkpoint as it was."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_apriel.config import launch_config, save_run_config
from megatron_apriel.parallel.rendezvous import free_port
from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.integration  # its tests start processes of their own

POISON = Path(__file__).resolve().parents[2] / "dist" / "nan_at_step.py"


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    save_run_config(launch_config("tiny_local", [f"run_dir={run}", "trainer.steps=6", "checkpoint.save_every=2",
                                                 "checkpoint.keep_last=0"])[0])  # what apriel-train writes
    # the trainer ranks as apriel-train's launcher starts them, with a NaN put into step 3's batch
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(POISON), "3", "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=600, env=launcher_env(), cwd=tmp_path)
    assert proc.returncode != 0
    err = proc.stderr
    assert "non-finite loss at step 3" in err and "group(s) [" in err and "step_00000002" in err, err[-4000:]
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved == ["latest", "step_00000002"]  # nothing after the last good one, no partial .tmp either
    assert (run / "checkpoints" / "latest").read_text() == "step_00000002"
    dcp_to_torch_save(run / "checkpoints" / "step_00000002" / "dist", tmp_path / "ckpt.pt")  # it loads whole
    weights = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in weights.values() if torch.is_tensor(v) and v.is_floating_point())
