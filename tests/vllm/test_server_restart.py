"""A vLLM server killed (SIGKILL of its process group) in the middle of a weight update of a tiny_cpu
run (the worst moment: the trainer is sending to it): the update fails, the launcher restarts the
server, the trainer reconnects the fleet and sends the current weights, the actor sends it no
request before it serves them, and the run finishes with a whole, lag-bounded stream."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from megatron_apriel.rollout.fleet import registered
from megatron_apriel.rollout.stream import StreamReader
from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.vllm
STEPS, KILL_AFTER, MAX_LAG = 10, 3, 1
BUCKET_BYTES = 8192  # small buckets: an update lasts long enough to be caught in the middle


def updates_begun(run) -> int:
    return (run / "logs" / "server_0.log").read_text().count("weight update: receiving")


def test_a_killed_server_is_restarted_and_serves_current_weights(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([shutil.which("apriel-train"), "--config-name", "tiny_cpu", f"run_dir={run}",
                             f"trainer.steps={STEPS}", f"weight_sync.bucket_bytes={BUCKET_BYTES}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=launcher_env(),
                            cwd=tmp_path)
    metrics = run / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= KILL_AFTER):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-4000:]
        time.sleep(0.5)
    started = updates_begun(run)
    while updates_begun(run) == started:  # the next update has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-4000:]
        time.sleep(0.01)
    (server,) = registered(run / "fleet")
    os.killpg(os.getpgid(server.pid), signal.SIGKILL)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-6000:]
    assert "server_0 exited with code -9; restarting it" in err
    assert "failed (attempt 1 of" in (run / "logs" / "trainer.log").read_text()  # it died mid-update
    (again,) = registered(run / "fleet")
    assert again.instance != server.instance and again.pid != server.pid

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS)) and rows[-1]["sync/reconnects"] >= 1
    reader, groups = StreamReader(run / "rollouts"), []
    while (g := reader.next_group()) is not None:
        groups.append(g)
    assert [g.seq for g in groups] == list(range(len(groups)))
    # every token was sampled by weights at least as new as the ones published when the group was
    # admitted: a restarted server's start-up weights (version label 0) never served a request
    assert all(g.min_version >= g.admitted_version for g in groups)
    assert any(g.admitted_version >= KILL_AFTER for g in groups)
    start = 0
    for row in rows:
        end = int(row["rollout/cursor"])
        lags = [row["step"] - g.min_version for g in groups[start:end] if g.dropped is None]
        assert sum(lag <= MAX_LAG for lag in lags) == 16
        start = end
