"""TP=1 (DP=2), TP=2 and PP=2, padded and packed: same log-probs, loss and updated weights.

Runs tests/dist/layouts.py under ``torchrun --nproc_per_node 2`` (gloo, real Megatron-Core).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_apriel.parallel.rendezvous import free_port

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts") / "results.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "dist" / "layouts.py"), str(out)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", ["gspo/tp2", "gspo/pp2", "gspo/tp1_dp2_packed", "gspo/tp2_packed", "gspo/pp2_packed"])
def test_logprobs_loss_and_step_agree_across_layouts(results, name):
    base, other = results["gspo/tp1_dp2"], results[name]
    assert len(base["logp"]) == 8
    assert _max_diff(base["logp"], other["logp"]) < ATOL
    for key in ("train/loss", "train/ratio_mean", "train/ratio_min", "train/ratio_max", "train/clip_fraction",
                "train/entropy", "train/grad_norm", "train/tokens", "train/seqs_filtered"):
        assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), key
    assert _max_diff(base["weights"], other["weights"]) < ATOL


def test_the_step_moves_the_weights(results):
    moved = _max_diff(results["initial"], results["gspo/tp1_dp2"]["weights"])
    assert moved > 1e-3  # so that the agreement above is not trivially about unchanged weights


def test_dapo_token_mean_agrees_between_dp_and_packed_pp(results):
    a, b = results["dapo/tp1_dp2"], results["dapo/pp2_packed"]
    assert a["metrics"]["train/loss"] == pytest.approx(b["metrics"]["train/loss"], abs=ATOL)
    assert _max_diff(a["weights"], b["weights"]) < ATOL
    assert a["metrics"]["train/loss"] != pytest.approx(results["gspo/tp1_dp2"]["metrics"]["train/loss"], abs=1e-3)


def test_some_sequences_hit_the_clip_and_one_is_filtered(results):
    m = results["gspo/tp1_dp2"]["metrics"]
    assert 0 < m["train/clip_fraction"] < 1
    assert m["train/seqs_filtered"] == 1
