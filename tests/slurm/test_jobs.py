"""The tiny CPU run through the shipped slurm/train.sbatch on a real SLURM (two virtual nodes), with
every stop signal SLURM really sends:

- a heterogeneous job submitted by apriel-submit: ``scancel -b --signal=USR1`` to the batch shell
  while its prepare step runs (the components are not started, the job requeues at once); then,
  in the next attempt, SLURM's own time-limit warning (``--signal=B:USR1@60`` after the test
  shortens the time limit, no scancel): the trainer saves, the job requeues; the third attempt
  resumes from that checkpoint and completes (every step trained once);
- a plain job by hand (plain ``sbatch``, the script's documented variables): a plain ``scancel``
  (SIGTERM to every process) while the trainer's checkpoint writers run: the save completes and
  is the newest checkpoint; the same job submitted again resumes from it and completes with the
  loop's outputs, and slurm/convert.sbatch converts its final checkpoint;
- a one-node job (the trainer and the fleet share a node whose fake GPUs SLURM schedules): each
  process gets its share of the GPUs; the time-limit warning's signal (``scancel -b --signal=USR1``)
  requeues it and the next attempt completes;
- a vLLM server killed inside a running job: the trainer saves its last step within its grace,
  the whole job ends within the stated bound, the job log names the server step, and no process
  of the job survives.

One vLLM server and a few steps each (tests/slurm/hold_python.sh holds a step where a signal must
land); about five minutes on 2 CPU cores. Each test's jobs are a *scenario* (``drive_*``) that runs in
the session's background from its first test on (tests/background.py), beside the unit tests; the
scenario collects what SLURM forgets (a job's state, 300 s after its end) and what must be seen at
once (leftover processes), and the test asserts on those facts when pytest reaches it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import new_run_dir
from tests.slurm.conftest import (
    REPO,
    ensure_cluster,
    job_env,
    job_field,
    leftovers,
    submit_cli,
    tail,
    wait_for,
    wait_gone,
)

pytestmark = pytest.mark.slurm
STOP_GRACE_S = 20  # tiny_cpu's slurm.stop_grace_s, checked below against the rendered script
KILL_WAIT_S = 10  # tools/setup_slurm.sh's KillWait
BOUND_S = 2 * STOP_GRACE_S + KILL_WAIT_S + 15
"""A failed component ends the job within 2 x APRIEL_STOP_GRACE_S + KillWait + 15 s (the watchdog's
SIGTERM grace for the trainer, then for the fleet, SLURM's SIGTERM->SIGKILL wait for cancelled
steps, polling and teardown)."""
HOLD_PYTHON = REPO / "tests" / "slurm" / "hold_python.sh"


def metrics(run: Path) -> list[dict]:
    path = run / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def submitted_job(out: str) -> str:
    m = re.search(r"submitted job (\d+)", out)
    assert m, out
    return m.group(1)


def assert_loop_outputs(run: Path, steps: int) -> None:
    """What the local launcher leaves: config, final checkpoint (at the last step), the durable
    stream, TensorBoard, one log per component and the Hugging Face export."""
    assert (run / "config.yaml").is_file()
    state = json.loads((run / "checkpoints" / f"step_{steps:08d}" / "state.json").read_text())
    assert state["step"] == steps
    assert any((run / "rollouts").iterdir()) and any((run / "tensorboard").iterdir())
    for name in ("prepare", "server_0", "actor", "trainer", "export"):
        assert (run / "logs" / f"{name}.log").stat().st_size > 0, name
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(run / "hf").num_hidden_layers >= 1
    assert list((run / "hf").glob("*.safetensors"))


def assert_each_step_once(run: Path, steps: int) -> list[dict]:
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(steps))
    cursors = [int(r["rollout/cursor"]) for r in rows]
    # step k trained the stream's groups [cursor_{k-1}, cursor_k): disjoint ranges, so nothing twice
    assert all(a < b for a, b in zip(cursors, cursors[1:])), cursors
    return rows


def start_when_requeued(job: str, log: Path, time_limit_min: int | None = None) -> None:
    """SLURM holds a requeued batch job for about two minutes (Reason=BeginTime), harmless on a
    cluster; here the test, as an administrator could, lets it start at once (with a new time limit)."""
    def held() -> bool:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%r"], capture_output=True, text=True).stdout
        return "BeginTime" in out
    wait_for(held, 600, "the requeued job", job, log)
    # slurmd refuses to launch a job within the second it killed it ("Job N already killed, do not
    # launch batch job": the relaunch's credential must be newer than the revocation, in seconds)
    time.sleep(2.0)
    extra = [f"TimeLimit={time_limit_min}"] if time_limit_min else []
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now", *extra], check=True)


def run_seconds(job: str) -> int:
    h, m, s = (["0"] + job_field(job, "RunTime").split("-")[-1].split(":"))[-3:]
    return 3600 * int(h) + 60 * int(m) + int(s)


def holds(tmp_path: Path, *armed: str) -> tuple[Path, dict]:
    """A holds directory with ``armed`` steps (tests/slurm/hold_python.sh) and the job env using it."""
    d = tmp_path / "holds"
    d.mkdir()
    for name in armed:
        (d / f"{name}.arm").touch()
    return d, {"APRIEL_TEST_HOLDS": str(d), "APRIEL_TEST_PYTHON": sys.executable}


def attempt_log(out: str, job: str, attempt: int) -> str:
    """The job log's lines of one attempt."""
    parts = re.split(rf"(?=\[apriel [0-9:]+\] job {job} attempt \d+ )", out)
    return next(p for p in parts if f"job {job} attempt {attempt} " in p)


def ended(job: str, run: Path, log: Path, **facts) -> SimpleNamespace:
    """The facts of a job that has just left the queue, collected before they fade: its state and
    restarts (``scontrol`` forgets them 300 s after the end), its log and its live processes."""
    return SimpleNamespace(job=job, run=run, log=log, out=log.read_text(), state=job_field(job, "JobState"),
                           restarts=job_field(job, "Restarts"), leftovers=leftovers(run, job), **facts)


def drive_hetjob(tmp_path: Path, tiny_base: Path) -> SimpleNamespace:
    """Attempt 0 is stopped in its prepare step (scancel's USR1), attempt 1 by SLURM's own time-limit
    warning after its first step (every trainer rank holds there until the warning reaches it:
    ``step.arm``, so the minute-granular limit needs no long run to land inside), attempt 2
    resumes at step 1 and finishes."""
    ensure_cluster()
    run, steps = new_run_dir(tmp_path, tiny_base), 3
    hold_dir, env = holds(tmp_path, "prepare", "step")
    proc = submit_cli(["--config-name", "tiny_cpu", f"run_dir={run}", f"trainer.steps={steps}", "slurm.time=00:10:00",
                       "slurm.signal_s=60", f"slurm.python={HOLD_PYTHON}"], job_env(**env))
    assert proc.returncode == 0, proc.stderr
    job = submitted_job(proc.stdout)
    log = run / "slurm" / f"apriel-{job}.out"

    # attempt 0: the warning reaches the batch shell while its prepare step runs
    wait_for(lambda: (hold_dir / "prepare.held").exists(), 300, "the prepare step", job, log)
    subprocess.run(["scancel", "-b", "--signal=USR1", job], check=True)
    wait_for(lambda: "before the trainer started: remembered" in log.read_text(), 60, "the remembered stop", job, log)
    (hold_dir / "prepare.go").touch()
    start_when_requeued(job, log)

    # attempt 1: SLURM's own warning, 60 s before a time limit the test brings close (no scancel)
    wait_for(lambda: len(metrics(run)) >= 1, 600, "a first step", job, log)
    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={-(-(run_seconds(job) + 65) // 60)}"], check=True)
    start_when_requeued(job, log, time_limit_min=10)
    wait_gone(job, 900, log)
    return ended(job, run, log, steps=steps, submitted=proc.stdout,
                 script=next((run / "slurm").glob("train.*.sbatch")).read_text())


@pytest.mark.background(scenario=drive_hetjob)
def test_hetjob_requeues_on_usr1_during_prepare_and_on_slurms_time_limit_warning(background):
    job = background()
    run, steps = job.run, job.steps
    assert str(job.log) in job.submitted and "heterogeneous job" in job.submitted
    assert f"APRIEL_STOP_GRACE_S={STOP_GRACE_S}" in job.script and "#SBATCH --signal=B:USR1@60" in job.script
    assert job.state == "COMPLETED", tail(job.log)
    assert job.restarts == "2", tail(job.log)
    first, second, third = (attempt_log(job.out, job.job, a) for a in range(3))
    assert "not starting them" in first and "started trainer" not in first
    assert "stop signal (SIGUSR1): the trainer finishes its step" in second and "requeueing job" in second
    assert "done:" in third
    rows = assert_each_step_once(run, steps)
    resumed = re.findall(r"resumed from \S+step_(\d+) at step (\d+)", (run / "logs" / "trainer.log").read_text())
    assert len(resumed) == 1, "the third attempt did not resume from the second one's checkpoint"
    k = int(resumed[0][1])
    assert k == 1  # held after step 1 until the warning came
    saved = json.loads((run / "checkpoints" / f"step_{k:08d}" / "state.json").read_text())
    assert saved["source"]["cursor"] == rows[k - 1]["rollout/cursor"]  # resumed where the stop left off
    assert_loop_outputs(run, steps)
    assert job.leftovers == []


def drive_plain_job(tmp_path: Path, tiny_base: Path) -> SimpleNamespace:
    """Job 1 is cancelled (plain scancel) while the trainer's checkpoint writers run; job 2, the same
    script submitted again, resumes and completes; then slurm/convert.sbatch converts its final
    checkpoint. What job 1 left is read before job 2 starts."""
    ensure_cluster()
    run, steps = new_run_dir(tmp_path, tiny_base), 3
    hold_dir, hold_env = holds(tmp_path, "save")
    env = job_env(APRIEL_PYTHON=str(HOLD_PYTHON), APRIEL_CONFIG="tiny_cpu",
                  APRIEL_OVERRIDES=f"trainer.steps={steps} checkpoint.save_every=2",
                  APRIEL_RUN_DIR=str(run), APRIEL_TRAIN_NODES="1", APRIEL_TRAIN_TASKS_PER_NODE="2",
                  APRIEL_SERVERS_PER_NODE="1", APRIEL_GPUS_PER_NODE="0",
                  APRIEL_ENV_FILE=str(REPO / "slurm" / "cluster.env"), APRIEL_STOP_GRACE_S=str(STOP_GRACE_S),
                  **hold_env)

    def submit(log: Path) -> str:
        proc = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", f"--output={log}",
                               str(REPO / "slurm" / "train.sbatch")], capture_output=True, text=True, env=env,
                              cwd=run.parent)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    log = run / "job1.out"
    job = submit(log)
    wait_for(lambda: (hold_dir / "save.held").exists(), 600, "the trainer's first save", job, log)
    subprocess.run(["scancel", job], check=True)  # SIGTERM to the batch shell and every process of every step
    wait_gone(job, 120, log)
    ckpts = run / "checkpoints"
    cancelled = ended(job, run, log, trainer_log=(run / "logs" / "trainer.log").read_text(),
                      latest=(ckpts / "latest").read_text().strip(), tmp_dirs=list(ckpts.glob("*.tmp")),
                      saved_state=(ckpts / "step_00000002" / "state.json").is_file())

    log = run / "job2.out"
    job = submit(log)
    wait_gone(job, 900, log)
    resumed = ended(job, run, log, trainer_log=(run / "logs" / "trainer.log").read_text())
    return SimpleNamespace(run=run, steps=steps, cancelled=cancelled, resumed=resumed,
                           convert=convert_final_checkpoint(run, steps))


def convert_final_checkpoint(run: Path, steps: int) -> SimpleNamespace:
    """slurm/convert.sbatch on the run's final checkpoint (Megatron -> HF), into ``run/../converted``."""
    out, log = run.parent / "converted", run.parent / "convert.out"
    env = job_env(APRIEL_PYTHON=sys.executable, APRIEL_CONVERT="mcore-to-hf", APRIEL_OUT=str(out),
                  APRIEL_SRC=str(run / "checkpoints" / f"step_{steps:08d}" / "dist"),
                  APRIEL_HF_REFERENCE=str(run / "base"))
    proc = subprocess.run(["sbatch", "--parsable", f"--output={log}", str(REPO / "slurm" / "convert.sbatch")],
                          capture_output=True, text=True, env=env, cwd=run.parent)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    wait_gone(job, 300, log)
    return SimpleNamespace(out=out, log=log, state=job_field(job, "JobState"))


@pytest.mark.background(scenario=drive_plain_job)
def test_plain_job_by_hand_survives_scancel_mid_save_and_resumes(background):
    facts = background()
    run, steps, first, second = facts.run, facts.steps, facts.cancelled, facts.resumed
    assert first.state == "CANCELLED", tail(first.log)
    # the batch shell waits for the trainer; whether it lives to log "the trainer exited" is a race
    # against KillWait (10 s here), when SLURM SIGKILLs it: under load the save plus the ranks' exit
    # took longer. What matters, the trainer's save, is checked below.
    assert "waiting for the trainer to save" in first.out, tail(first.log)
    assert "stop request (SIGTERM) before step 2: saved step 2 and stopping" in first.trainer_log, \
        first.trainer_log[-3000:]
    assert first.latest == "step_00000002" and first.tmp_dirs == [] and first.saved_state
    assert first.leftovers == []

    assert second.state == "COMPLETED", tail(second.log)
    assert re.search(r"\(plain\): trainer on n1 .* fleet on n2", second.out), second.out[:2000]
    # the job log says how long the fleet took to stop once the trainer had exited (not bounded here:
    # a figure to read, as the local launcher's "stopped actor, server_0 in ...")
    assert re.search(r"stopped actor servers in \d+\.\ds", second.out), tail(second.log)
    assert "resumed from" in second.trainer_log[len(first.trainer_log):]
    assert_each_step_once(run, steps)
    assert_loop_outputs(run, steps)
    assert second.leftovers == []
    assert_converted_matches_the_export(facts.convert, run)


def assert_converted_matches_the_export(convert: SimpleNamespace, run: Path) -> None:
    """slurm/convert.sbatch on the final checkpoint gives the tensors of the job's own HF export."""
    import torch
    from safetensors.torch import load_file

    assert convert.state == "COMPLETED", tail(convert.log)
    ours = {k: v for f in sorted(convert.out.glob("*.safetensors")) for k, v in load_file(f).items()}
    export = {k: v for f in sorted((run / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert ours.keys() == export.keys() and all(torch.equal(ours[k], export[k]) for k in ours)


def drive_one_node_job(tmp_path: Path, tiny_base: Path) -> SimpleNamespace:
    """The one-node job, its vLLM server SIGKILLed after the first step; how long the job took to end."""
    ensure_cluster()
    run = new_run_dir(tmp_path, tiny_base)
    proc = submit_cli(["--config-name", "tiny_cpu", f"run_dir={run}", "trainer.steps=50",
                       "launch.gpus_per_node=4", "slurm.gpus_per_node=4", "slurm.servers_per_node=0"], job_env())
    assert proc.returncode == 0, proc.stderr
    job = submitted_job(proc.stdout)
    log = run / "slurm" / f"apriel-{job}.out"
    wait_for(lambda: len(metrics(run)) >= 1, 600, "first step", job, log)
    [reg] = [json.loads(p.read_text()) for p in (run / "fleet").glob("*.json")]
    os.kill(reg["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    wait_gone(job, 300, log)
    return ended(job, run, log, took=time.monotonic() - t0, submitted=proc.stdout)


@pytest.mark.background(scenario=drive_one_node_job)
def test_one_node_job_hands_out_the_gpus_and_a_killed_server_ends_it(background):
    """The trainer and the fleet share one node whose 4 GPUs SLURM schedules (fake GRES,
    tools/setup_slurm.sh): the server takes GPU 0 and the trainer's ranks 1,2 (launch.gpus_per_node's
    split, as the local launch makes it). After the first step the vLLM server is SIGKILLed, as the
    OOM killer would: the job ends (FAILED) within a bound, showing the server's log, and the
    trainer saves its last step within its grace. (Requeue and resume are the hetjob test's: the
    same train.sbatch code for every layout.)"""
    job = background()
    run, out = job.run, job.out
    assert ("one-node plain job: 2 trainer rank(s) and 1 vLLM server(s) sharing its 4 GPUs (servers on GPUs 0, "
            "trainer on 1,2, idle 3)") in job.submitted
    assert re.search(r"\(one node\): trainer on (n\d) .* fleet on \1 ", out), out[:2000]
    logs = run / "logs"
    assert "servers 0, trainer 1,2, idle 3" in (logs / "prepare.log").read_text()  # SLURM's CUDA_VISIBLE_DEVICES
    served = re.findall(r"serve: server 0 on n\d \S+, GPUs (\S+)", (logs / "server_0.log").read_text())
    assert served == ["0"], served
    trainer_log = (logs / "trainer.log").read_text()
    assert re.findall(r"the trainer's ranks on GPUs (\S+)", trainer_log) == ["1,2"]

    assert job.took < BOUND_S, f"the job took {job.took:.0f}s to end after the server died (bound {BOUND_S}s):\n{out}"
    assert "component servers exited with code" in out and "job failed" in out, tail(job.log)
    assert str(logs / "server_0.log") in out  # its log's tail is shown
    assert "still running after" not in out, tail(job.log)  # the trainer stopped within its grace
    trained = len(metrics(run))
    assert "stop request (SIGTERM)" in trainer_log
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{trained:08d}"  # its last step, saved
    assert job.state == "FAILED"
    assert job.leftovers == []
