"""The drift gate on the real tiny_cpu loop. A vLLM server in bfloat16 while the trainer computes in
float32 is a real engine mismatch: fresh-token drift ~4e-4 to 7e-4 nats/token here, against ~2e-7 with
both in float32. fleet.drift_gate.max_drift=1e-4 lies between the two (a factor of ~4 and ~500).

- Two servers, the second in bfloat16 (fleet.per_server_vllm_args): it trips on step 0's fresh tokens,
  is named, taken out of the fleet and restarted by the launcher; the actor stops using it; the run
  goes on with the other server and finishes.
- One server, in bfloat16: it trips, every server has tripped, so the run stops after saving the
  step, naming the server, its version and the figure."""

import json
import re
import shutil
import subprocess

import psutil
import pytest

from tests.conftest import new_run_dir
from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.vllm
MAX_DRIFT = 1e-4


GATE = ["fleet.drift_gate.enabled=true", f"fleet.drift_gate.max_drift={MAX_DRIFT}", "launch.export_hf=false"]


def launch(parent, tiny_base, *overrides):
    run = new_run_dir(parent, tiny_base)
    proc = subprocess.run([shutil.which("apriel-train"), "--config-name", "tiny_cpu", f"run_dir={run}", *GATE,
                           *overrides], capture_output=True, text=True, timeout=900, env=launcher_env(), cwd=run.parent)
    return run, proc


@pytest.fixture(scope="module")
def gated(tmp_path_factory, tiny_base):
    return launch(tmp_path_factory.mktemp("gate"), tiny_base, "trainer.steps=3", "fleet.vllm_args=[--dtype,bfloat16]",
                  "fleet.drift_gate.window_tokens=400")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tiny_base):
    # max_lag=0: every step trains the groups of both servers (the actor admits what the step needs, and
    # spreads them over the servers), all fresh; so the bfloat16 server's figure comes with step 0
    return launch(tmp_path_factory.mktemp("mixed"), tiny_base, "trainer.steps=5", "fleet.num_servers=2",
                  "fleet.per_server_vllm_args=[[],[--dtype,bfloat16]]", "fleet.max_restarts=5", "rollout.max_lag=0",
                  "fleet.drift_gate.window_tokens=100")


def port_of(run, component: str) -> str:
    """The port the launcher gave ``component`` (its command line heads its log)."""
    return re.search(r"--port (\d+)", (run / "logs" / f"{component}.log").read_text()).group(1)


def test_the_bfloat16_server_of_two_is_named_retired_and_restarted_and_the_run_finishes(mixed):
    run, proc = mixed
    assert proc.returncode == 0, proc.stderr[-4000:]
    bf16, fp32 = f"127.0.0.1:{port_of(run, 'server_1')}", f"127.0.0.1:{port_of(run, 'server_0')}"
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert f"drift gate: server {bf16} (weights version 0) drifted" in trainer_log
    assert "taking it out of the fleet and restarting it" in trainer_log and fp32 + " (weights" not in trainer_log
    assert re.search(r"server_1 exited with code -?\d+; restarting it", proc.stderr)  # by the launcher, as a crash
    assert "actor exited" not in proc.stderr and "server_0 exited" not in proc.stderr
    assert f"server http://{bf16} left the fleet" in (run / "logs" / "actor.log").read_text()
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and sum(r["gate/trips"] for r in rows) >= 1
    assert rows[0][f"mismatch/server/{bf16}/fresh_abs_log_rho"] > MAX_DRIFT  # tripped on its own figure
    assert rows[0][f"mismatch/server/{fp32}/fresh_abs_log_rho"] < MAX_DRIFT / 100  # float32: round-off


def test_the_run_stops_naming_the_server_its_version_and_its_drift(gated):
    run, proc = gated
    assert proc.returncode != 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    (server,) = {k.split("/")[2] for k in row if k.startswith("mismatch/server/")}
    drift = row[f"mismatch/server/{server}/fresh_abs_log_rho"]
    assert drift > 5 * MAX_DRIFT and row["gate/trips"] == 1 and row["step"] == 0
    named = f"server {server} (weights version 0) drifted {drift:.4g} nats/token over " \
            f"{int(row[f'mismatch/server/{server}/fresh_tokens'])} fresh tokens"
    assert named in (run / "logs" / "trainer.log").read_text()
    assert f"DriftGateError: drift gate: every server of the fleet (['{server}'])" in proc.stderr  # the root cause
    assert (run / "checkpoints" / "step_00000001").is_dir()  # the step that tripped is saved
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert not left
