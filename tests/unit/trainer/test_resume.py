"""Exact resume: N steps, stop, resume to N+M == N+M uninterrupted; a stop signal saves and exits."""

import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_apriel.parallel.rendezvous import free_port
from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.integration  # its tests start processes of their own

# model.dropout: every step draws from the torch RNG, so the resumed run is exact only if the RNG is restored
COMMON = ["--config-name", "tiny_local", "optim.decay_steps=4", "checkpoint.save_every=2", "checkpoint.keep_last=0",
          "model.dropout=0.1"]


def train(run_dir: Path, steps: int, *extra: str) -> None:
    cmd = [shutil.which("apriel-train"), *COMMON, f"run_dir={run_dir}", f"trainer.steps={steps}",
           f"launch.master_port={free_port()}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=launcher_env(), cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def checkpoint_tensors(run_dir: Path, step: int, tmp: Path) -> dict:
    out = tmp / f"{run_dir.name}_{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step_{step:08d}" / "dist", out)
    return torch.load(out, weights_only=False)


def preempted_copy(straight: Path, resumed: Path, step: int) -> None:
    """``resumed``: ``straight`` as a run preempted right after saving ``step`` would have left it
    (every later checkpoint gone, ``latest`` naming ``step``). The same run directory, not a second
    launch: the resumed launch reads what the uninterrupted one wrote."""
    shutil.copytree(straight, resumed)
    ckpts = resumed / "checkpoints"
    for later in ckpts.glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    (ckpts / "latest").write_text(f"step_{step:08d}")
    assert sorted(p.name for p in ckpts.glob("step_*")) == [f"step_{step:08d}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    straight, resumed = root / "straight", root / "resumed"
    train(straight, 4)  # saves steps 2 and 4 (LR decay over 4 steps, fixed)
    preempted_copy(straight, resumed, 2)
    train(resumed, 4)  # picks up step_00000002 by itself
    return root, straight, resumed


def test_resumed_run_ends_with_identical_weights_and_optimizer_state(runs):
    root, straight, resumed = runs
    a, b = checkpoint_tensors(straight, 4, root), checkpoint_tensors(resumed, 4, root)
    assert a.keys() == b.keys()
    tensors = [k for k, v in a.items() if torch.is_tensor(v)]
    assert any("exp_avg" in k for k in tensors) and any("linear_qkv.weight" in k for k in tensors)
    for k in tensors:
        assert torch.equal(a[k], b[k]), k
    # and training did move the weights between the two checkpoints
    mid = checkpoint_tensors(straight, 2, root)
    assert not torch.equal(mid["embedding.word_embeddings.weight"], a["embedding.word_embeddings.weight"])


def test_incomplete_checkpoint_is_never_resumed(runs, tmp_path):
    _, straight, _ = runs
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    (run / "checkpoints" / "latest").write_text("step_00000006")  # names a checkpoint that never completed
    from megatron_apriel.trainer.checkpoint import latest_checkpoint

    with pytest.raises(FileNotFoundError, match="incomplete or missing"):
        latest_checkpoint(run / "checkpoints")


def test_stop_signal_saves_and_exits_cleanly(tmp_path):
    run = tmp_path / "signalled"
    cmd = [shutil.which("apriel-train"), *COMMON, f"run_dir={run}", "trainer.steps=1000", "checkpoint.save_every=0",
           f"launch.master_port={free_port()}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launcher_env(),
                            cwd=tmp_path)
    deadline, seen = time.time() + 300, []
    for line in proc.stdout:  # wait until training is under way
        seen.append(line)
        if "step 2 |" in line or time.time() > deadline:
            break
    assert "step 2 |" in seen[-1], "".join(seen)[-4000:]
    def is_rank(p: psutil.Process) -> bool:  # torchrun's children: not torchrun, nor a rank's forked helper
        cmd = " ".join(p.cmdline())
        return ("megatron_apriel.entrypoints.train" in cmd and "torch.distributed.run" not in cmd
                and "torch.distributed.run" in " ".join(p.parent().cmdline()))

    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if is_rank(p)]
    assert len(ranks) == 2
    for p in ranks:  # what SLURM's --signal=USR1@<s> does: signal every task
        p.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-4000:]
    saved = sorted((run / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and 3 <= int(saved[0].name.split("_")[1]) < 1000
    assert (run / "checkpoints" / "latest").read_text() == saved[0].name


def test_trainer_checkpoint_exports_to_hugging_face(runs, tmp_path):
    """`apriel-convert mcore-to-hf` reads a trainer checkpoint (no HF reference: apriel_model.json)."""
    from transformers import AutoModelForCausalLM

    from megatron_apriel.convert.checkpoint import mcore_to_hf

    root, straight, _ = runs
    dist_dir = straight / "checkpoints" / "step_00000004" / "dist"
    out = tmp_path / "hf"
    mcore_to_hf(dist_dir, out, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trained = checkpoint_tensors(straight, 4, root)
    sd = hf.state_dict()
    assert torch.equal(sd["model.embed_tokens.weight"], trained["embedding.word_embeddings.weight"][:256])
    assert torch.equal(sd["lm_head.weight"], trained["output_layer.weight"][:256])
    assert torch.equal(sd["model.layers.1.mlp.down_proj.weight"], trained["decoder.layers.mlp.linear_fc2.weight"][1])
    logits = hf(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()
