"""Fixtures shared by the vLLM and SLURM tests: the tiny run's warm-started base, built once per
test session and copied into each run directory that needs it (the launch, or the job's prepare
step, finds it ready and skips the build)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


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

