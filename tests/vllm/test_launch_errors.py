"""A vLLM server that never becomes healthy: the launcher says which, shows its log, stops everything."""

import shutil
import subprocess

import pytest

from tests.conftest import new_run_dir
from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.vllm


def test_a_server_that_never_becomes_healthy_fails_the_run_with_its_log(tmp_path, tiny_base):
    run = new_run_dir(tmp_path, tiny_base)
    proc = subprocess.run([shutil.which("apriel-train"), "--config-name", "tiny_cpu", f"run_dir={run}",
                           "fleet.vllm_args=[--no-such-vllm-flag]"], capture_output=True, text=True, timeout=600,
                          env=launcher_env(), cwd=tmp_path)
    assert proc.returncode == 1
    assert "server_0 exited with code" in proc.stderr and "before it was healthy" in proc.stderr
    assert "--no-such-vllm-flag" in proc.stderr  # vLLM's own complaint, from the tail of its log
    assert not (run / "logs" / "trainer.log").exists()  # nothing else was started
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run) not in ps
