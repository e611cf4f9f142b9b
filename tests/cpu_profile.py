"""A pytest plugin that records, for every test phase, its wall time, the CPU the whole machine
spent meanwhile (every process: the test's own launches, servers and SLURM daemons included, and
anything else that ran), and the CPU of this pytest process and the children it reaped in that
phase (``own_cpu_s``: a launch's whole tree once the test has waited for it; a server that outlives
its test, such as the session's vLLM server, counts where it is reaped, at the end; SLURM's jobs
run under its daemons and count only in the machine figure).

    APRIEL_SUITE_PROFILE=runs/profile.jsonl python -m pytest -p tests.cpu_profile ...
    python -m tools.suite_profile runs/profile.jsonl      # the per-module table

The CPU figure is read from /proc/stat (busy ticks of all cores), so it is exact for a quiet
machine and counts anything else that runs beside the suite.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float:
    """CPU seconds the machine's cores have been busy since boot (all but idle and iowait)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) * _TICK_S  # steal is not ours; guest is in user


def own_cpu_s() -> float:
    """CPU seconds of this process and of the children it has reaped (and theirs, recursively)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _out_path() -> Path | None:
    path = os.environ.get("APRIEL_SUITE_PROFILE")
    return Path(path) if path else None


class _Recorder:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)
        self._file.write(json.dumps({"session_start": time.time(), "cores": os.cpu_count()}) + "\n")

    def phase(self, item: pytest.Item, when: str, t0: float, c0: float, o0: float) -> None:
        row = {"nodeid": item.nodeid, "when": when, "start": t0, "wall_s": round(time.time() - t0, 3),
               "cpu_s": round(busy_cpu_s() - c0, 2), "own_cpu_s": round(own_cpu_s() - o0, 2)}
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


_recorder: _Recorder | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _recorder
    path = _out_path()
    if path is not None:
        _recorder = _Recorder(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _recorder is not None:
        _recorder.close()


def _timed(when: str):
    @pytest.hookimpl(hookwrapper=True)
    def hook(item: pytest.Item):
        if _recorder is None:
            yield
            return
        t0, c0, o0 = time.time(), busy_cpu_s(), own_cpu_s()
        yield
        _recorder.phase(item, when, t0, c0, o0)
    return hook


pytest_runtest_setup = _timed("setup")
pytest_runtest_call = _timed("call")
pytest_runtest_teardown = _timed("teardown")
