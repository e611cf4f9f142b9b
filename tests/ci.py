"""Whether the suite runs under CI, where a test that cannot run on the machine must fail, not skip.

`.ci/run` exports ``CI=true``; CI services set it too, usually to ``true`` (some to ``True`` or ``1``).
A skip there would turn a machine that cannot run a test into a green run.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

_TRUE = ("1", "true", "yes", "on")


def in_ci() -> bool:
    """``CI`` holds a true value: 1, true, yes or on, in any case."""
    return os.environ.get("CI", "").strip().lower() in _TRUE


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the calling test, or fail it under CI, which must run every test."""
    if in_ci():
        pytest.fail(f"{reason} (CI={os.environ['CI']!r}: under CI this test must run, not skip)", pytrace=False)
    pytest.skip(reason)
