"""Tests whose work is mostly waiting (SLURM's jobs: the scheduler, minute-granular time limits,
requeues) run in the background of the session. Each such test names a *scenario*: a function
``scenario(tmp_path, tiny_base) -> facts`` that submits and drives its jobs and returns what the
test asserts on. Every scenario starts, on one thread, with the session's first test, and runs
beside the unit tests, filling the core they leave idle; when pytest reaches the test, it waits
for its scenario's facts (or its exception, re-raised: a failure, a skip) and asserts on them.

    def drive_job(tmp_path, tiny_base) -> dict: ...        # submits, waits, collects

    @pytest.mark.background(scenario=drive_job)
    def test_job(background):
        facts = background()                                # drive_job's return, once it is done
        assert facts["state"] == "COMPLETED"

Scenarios run one after another, in the tests' order, so their jobs never compete with each other.
A scenario must collect what fades (``scontrol`` forgets a job 300 s after its end, a leftover
process may exit later) before it returns. When the session ends first (``-x``, a failure),
``STOPPING`` is set: the waits of tests/slurm/conftest.py then cancel their job and give up.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import pytest

Scenario = Callable[[Path, Path], Any]
STOPPING = threading.Event()
JOIN_TIMEOUT_S = 300  # a stopped scenario cancels its job and returns within its polling interval
_AT_END: list[Callable[[], None]] = []


def at_end(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` on the scenarios' thread after the last scenario (stopping what they started);
    its failure is the session's teardown error."""
    _AT_END.append(cleanup)


def pytest_configure(config):
    config.addinivalue_line("markers", "background(scenario=fn): the test asserts on a scenario that runs in the "
                                       "background from the session's start (tests/background.py)")


def scenario_of(item: pytest.Item) -> Scenario | None:
    marker = item.get_closest_marker("background")
    return marker.kwargs["scenario"] if marker else None


class Scenarios:
    """The session's scenarios, each with the future of its facts, run in order on one thread."""

    def __init__(self, scenarios: list[tuple[Scenario, Path]], tiny_base: Path) -> None:
        self._todo = scenarios
        self._tiny_base = tiny_base
        self._futures: dict[Scenario, Future] = {scenario: Future() for scenario, _ in scenarios}
        self._thread = threading.Thread(target=self._run, name="background-scenarios", daemon=True)
        self._cleanup_error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def result(self, scenario: Scenario) -> Any:
        return self._futures[scenario].result()

    def stop(self) -> None:
        """Ask the running scenario to give up (its job cancelled), and wait for the thread."""
        STOPPING.set()
        self._thread.join(JOIN_TIMEOUT_S)
        assert not self._thread.is_alive(), f"a background scenario still runs {JOIN_TIMEOUT_S}s after the session"
        if self._cleanup_error is not None:
            raise self._cleanup_error

    def _run(self) -> None:
        try:
            self._run_scenarios()
        finally:
            while _AT_END:
                try:
                    _AT_END.pop()()
                except BaseException as e:  # noqa: BLE001 - raised by stop(), on the main thread
                    self._cleanup_error = self._cleanup_error or e

    def _run_scenarios(self) -> None:
        for scenario, tmp_path in self._todo:
            future = self._futures[scenario]
            if STOPPING.is_set():
                future.cancel()
                continue
            try:
                future.set_result(scenario(tmp_path, self._tiny_base))
            except BaseException as e:  # noqa: BLE001 - re-raised in the scenario's test (failures and skips alike)
                future.set_exception(e)


@pytest.fixture(scope="session", autouse=True)
def background_scenarios(request, tmp_path_factory):
    """Starts the selected tests' scenarios with the session's first test; at the end, stops them."""
    todo: dict[Scenario, Path] = {}
    for item in request.session.items:
        scenario = scenario_of(item)
        if scenario is not None and scenario not in todo:
            todo[scenario] = tmp_path_factory.mktemp(scenario.__name__)
    if not todo:
        yield None
        return
    scenarios = Scenarios(list(todo.items()), request.getfixturevalue("tiny_base"))
    STOPPING.clear()
    scenarios.start()
    yield scenarios
    scenarios.stop()


@pytest.fixture
def background(request, background_scenarios) -> Callable[[], Any]:
    """``background()`` waits for this test's scenario and returns its facts (or raises its error)."""
    scenario = scenario_of(request.node)
    assert scenario is not None, "the `background` fixture needs @pytest.mark.background(scenario=...) on the test"
    return lambda: background_scenarios.result(scenario)
