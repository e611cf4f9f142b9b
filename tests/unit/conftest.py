import os

import pytest

from megatron_apriel.rollout.types import Problem
from tests.ci import skip_or_fail


def make_problem(domain, reference, prompt="solve", pid="t"):
    return Problem(id=pid, domain=domain, prompt=[{"role": "user", "content": prompt}], reference=reference)


def apriel(answer: str, reasoning: str = "Here are my reasoning steps:\nthinking...") -> str:
    """A completion in Apriel's output format."""
    return f"{reasoning}\n[BEGIN FINAL RESPONSE]\n{answer}\n[END FINAL RESPONSE]"


def launcher_env() -> dict:
    """The environment of a user's shell: no rendezvous variables from an enclosing launcher."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return dict({k: v for k, v in os.environ.items() if k not in drop}, PYTHONWARNINGS="ignore")


def require_root() -> None:
    """Skip the calling test unless it runs as root; under CI, fail it instead (see tests/ci.py)."""
    if os.geteuid() != 0:
        skip_or_fail(f"the namespace sandbox needs root, this runs as uid {os.geteuid()}: run the suite as root")


@pytest.fixture
def needs_root():
    require_root()
