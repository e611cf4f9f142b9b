"""A stop signal to every process of a trainer rank during a checkpoint save (scancel, SLURM's time
limit) does not lose the save: it completes, the run stops after it, and it resumes.

The scenario runs in a fresh interpreter (tests/dist/stop_during_save.py); without
``shield_checkpoint_writer`` it fails there (Megatron's results manager is killed: BrokenPipe or
ConnectionRefused in the save, only ``step_N.tmp`` left).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.integration  # its tests start processes of their own

REPO = Path(__file__).resolve().parents[3]


def test_a_save_survives_stop_signals_to_all_its_processes_and_the_run_stops_after_it(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "dist" / "stop_during_save.py"), str(tmp_path / "run"),
                           str(out)], capture_output=True, text=True, timeout=600, env=launcher_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["writer_signalled"]  # the signals really came from inside the save
    assert r["signal"] in ("SIGTERM", "SIGUSR1")
    assert r["latest"] == "step_00000001" and r["left_tmp"] == []  # the save in progress completed
    assert r["steps_run"] == 1 and r["step"] == 1  # acted on right after it: step 2 was not trained
    assert r["helpers_alive"] == [True, True]  # resource tracker and results manager ignored both signals
    assert r["resumed_step"] == 1
    # what the job script's grace uses: 1.5 x (slowest step + last save) + 5 s, written at each save
    assert int(r["stop_seconds"]) >= int(1.5 * r["train_s"]) + 5
