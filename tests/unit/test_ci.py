"""Under CI a test that cannot run fails with its reason; elsewhere it skips (tests/ci.py)."""

import os

import pytest

from tests.ci import in_ci
from tests.unit.conftest import require_root


@pytest.mark.parametrize("value", ["true", "TRUE", "True", "1", "yes", "Yes", "on", "ON", " true\n"])
def test_truthy_spellings_mean_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert in_ci()


@pytest.mark.parametrize("value", ["", "false", "0", "no", "off", "nope"])
def test_other_values_and_no_value_do_not(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert not in_ci()
    monkeypatch.delenv("CI")
    assert not in_ci()


@pytest.mark.parametrize("value", ["true", "1", "Yes"])
def test_non_root_sandbox_tests_fail_under_ci_with_the_reason(monkeypatch, value):
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="needs root.*uid 65534.*must run, not skip"):
        require_root()


def test_non_root_sandbox_tests_skip_outside_ci(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        require_root()


def test_root_runs_them_in_and_outside_ci(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    for value in ("true", ""):
        monkeypatch.setenv("CI", value)
        require_root()  # neither skips nor fails
