"""The drift gate on the real tiny_cpu loop: vLLM serves in bfloat16 while the trainer computes in
float32, a real engine mismatch (fresh-token drift ~7e-4 nats/token here, against ~2e-7 with both in
float32). With fleet.drift_gate.max_drift=1e-4, between the two by a factor of ~7 and ~500, the one
server trips on step 0's fresh tokens: every server has tripped, so the run stops after saving the
step, naming the server, its version and the figure. (Retiring one server of several, and its
restart, are tested part by part in tests/unit/trainer/test_drift_gate.py.)"""

import json
import shutil
import subprocess

import psutil
import pytest

from tests.conftest import new_run_dir
from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.vllm
MAX_DRIFT = 1e-4


@pytest.fixture(scope="module")
def gated(tmp_path_factory, tiny_base):
    run = new_run_dir(tmp_path_factory.mktemp("gate"), tiny_base)
    proc = subprocess.run([shutil.which("apriel-train"), "--config-name", "tiny_cpu", f"run_dir={run}",
                           "trainer.steps=3", "launch.export_hf=false", "fleet.vllm_args=[--dtype,bfloat16]",
                           "fleet.drift_gate.enabled=true", "fleet.drift_gate.window_tokens=500",
                           f"fleet.drift_gate.max_drift={MAX_DRIFT}"],
                          capture_output=True, text=True, timeout=900, env=launcher_env(), cwd=run.parent)
    return run, proc


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
