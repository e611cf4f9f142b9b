import os
import subprocess
import sys

import pytest

from megatron_apriel import _patches


def test_unsupported_megatron_version_fails_loudly(monkeypatch):
    monkeypatch.setattr(_patches, "mcore_version", lambda: "0.12.0")
    with pytest.raises(RuntimeError, match="megatron-core 0.12.0 is not supported"):
        _patches.check_mcore_version()


def test_installed_version_is_supported():
    assert _patches.check_mcore_version().startswith(_patches.SUPPORTED_MCORE_PREFIXES)


@pytest.mark.parametrize("env, cpus", [
    ({"GOMP_CPU_AFFINITY": "0 2 3", "OMP_NUM_THREADS": "3"}, {0, 2, 3}),  # vLLM's form with libgomp
    ({"OMP_PLACES": "{4,5}", "OMP_PROC_BIND": "true"}, {4, 5}),  # without a preloaded OpenMP
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[1,2]"}, {1, 2}),  # with Intel's
    ({"GOMP_CPU_AFFINITY": "0-2 7"}, {0, 1, 2, 7}),
    ({}, None),  # VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM sets none of them, nothing is bound
])
def test_a_forked_vllm_worker_is_bound_to_the_cpus_vllm_chose_for_it(env, cpus):
    assert _patches.worker_cpus(env) == cpus


def test_spawn_asked_for_in_the_environment_leaves_vllm_unpatched(monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert _patches.fork_vllm_cpu_processes() is False


def test_megatron_is_imported_on_the_cpu_without_its_jit_fuser():
    """The CPU patches import Megatron-Core with torch.compile off for the import: no TorchDynamo
    or Inductor is loaded (~2 s of a rank's start), the fuser is a no-op and torch.compile is back."""
    code = ("import sys, torch; real = torch.compile\n"
            "from megatron_apriel._patches import apply_cpu_patches; apply_cpu_patches()\n"
            "from megatron.core.models.gpt import GPTModel\n"
            "from megatron.core import jit\n"
            "assert torch.compile is real\n"
            "assert jit.jit_fuser(len) is len\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
