"""Fixtures shared by the vLLM and SLURM tests: the tiny run's warm-started base, built once per
test session and copied into each run directory that needs it (the launch, or the job's prepare
step, finds it ready and skips the build)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from megatron_apriel.launch.components import FIRST_CORE_ENV


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """``tiny_cpu``'s base (tokenizer, warm-started Llama, addition.jsonl), as its launch builds it."""
    from megatron_apriel.tiny.base import build_warm_base
    from megatron_apriel.tiny.config import TinyBaseConfig

    return build_warm_base(tmp_path_factory.mktemp("tiny") / "base", TinyBaseConfig())


def new_run_dir(parent: Path, tiny_base: Path) -> Path:
    """``parent/run`` holding a copy of the tiny base at ``run/base``, where ``tiny_cpu`` builds it."""
    run = parent / "run"
    shutil.copytree(tiny_base, run / "base")
    return run


# --- running the suite on two workers (pytest-xdist, pytest.ini) -----------------------------------

COSTS = Path(__file__).with_name("module_costs.json")
"""Each module's measured seconds (setup + call + teardown, one worker, a quiet 2-core machine):
``python -m tools.suite_profile PROFILE --write-costs tests/module_costs.json`` after a profiled run."""


def pytest_configure(config) -> None:
    """Under xdist, worker N's vLLM servers start from core N (``APRIEL_FIRST_CORE``), so the two
    workers' servers do not share a core; every launch a worker starts inherits it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        os.environ.setdefault(FIRST_CORE_ENV, worker[2:])


def module_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items) -> None:
    """The costliest modules first (``COSTS``; unknown ones after them, in collection order), each
    module's tests kept together and in order: with ``--dist loadfile`` each worker takes the next
    module when it is nearly done, and the two end close together (longest first)."""
    costs = json.loads(COSTS.read_text()) if COSTS.exists() else {}
    first_seen = {m: i for i, m in enumerate(dict.fromkeys(module_of(it) for it in items))}
    items.sort(key=lambda it: (-costs.get(module_of(it), 0.0), first_seen[module_of(it)]))
