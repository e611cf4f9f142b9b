"""Where a launched run's time goes, read from its run directory's logs (each launch of it: a
resumed run has several): each vLLM server's start to healthy, the actor's start to its first line
of work, the trainer's start to its model built ("initial weights"), the wait for the first step,
the steps themselves, and the end.

    python -m tools.launch_costs RUN_DIR [RUN_DIR ...]
    python -m tools.launch_costs --glob '/tmp/pytest-of-root/pytest-current/**/run'   # a suite's runs

Times come from the logs' own timestamps (one-second resolution), so they are the wall clock of a
run on whatever the machine did meanwhile; the suite's per-module table is tools/suite_profile.py.
"""

from __future__ import annotations

import argparse
import glob
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

_HEADER = re.compile(r"^=== (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) ")
_OURS = re.compile(r"^\[(\d\d:\d\d:\d\d) ")
_VLLM = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[entry\.py:\d+\] Starting vLLM server")
_STEP = re.compile(r"^\[(\d\d:\d\d:\d\d) rank\d+\] step (\d+) \|.* step_s=([\d.]+)")


@dataclass
class Launch:
    """One start of a component (its log's ``===`` header) and the moments read after it."""
    start: datetime
    marks: dict[str, datetime] = field(default_factory=dict)
    steps: list[float] = field(default_factory=list)


def _at(day: datetime, hhmmss: str) -> datetime:
    t = datetime.strptime(hhmmss, "%H:%M:%S").time()
    return datetime.combine(day.date(), t)


def launches(log: Path, marks: dict[str, re.Pattern]) -> list[Launch]:
    """Each start recorded in ``log`` with the first time each of ``marks`` matched after it."""
    out: list[Launch] = []
    for line in log.read_text(errors="replace").splitlines():
        if m := _HEADER.match(line):
            out.append(Launch(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")))
            continue
        if not out:
            continue
        cur = out[-1]
        if m := _VLLM.search(line):
            cur.marks.setdefault("healthy", _at(cur.start, m.group(1).split()[1]))
        if m := _STEP.match(line):
            cur.steps.append(float(m.group(3)))
            cur.marks.setdefault("first_step", _at(cur.start, m.group(1)))
            cur.marks["last_step"] = _at(cur.start, m.group(1))
        for name, pattern in marks.items():
            if name not in cur.marks and (m := pattern.search(line)) and (t := _OURS.match(line)):
                cur.marks[name] = _at(cur.start, t.group(1))
    return out


def _seconds(a: Optional[datetime], b: Optional[datetime]) -> str:
    return "-" if a is None or b is None else f"{(b - a).total_seconds():.0f}"


def describe(run: Path) -> list[str]:
    logs = run / "logs"
    rows = []
    trainer = launches(logs / "trainer.log", {"built": re.compile(r"initial weights|resumed from"),
                                              "done": re.compile(r"\] done: |stopped at step|saved step")}) \
        if (logs / "trainer.log").exists() else []
    actor = launches(logs / "actor.log", {"ready": re.compile(r"\] actor: ")}) if (logs / "actor.log").exists() else []
    servers = {p.stem: launches(p, {}) for p in sorted(logs.glob("server_*.log"))}
    for i, t in enumerate(trainer):
        before = [[s for s in ls if s.start <= t.start][-1:] for ls in servers.values()]  # each server's start
        to_healthy = [(s.marks["healthy"] - s.start).total_seconds() for [s] in filter(None, before)
                      if "healthy" in s.marks]
        server_s = max(to_healthy, default=None)
        a = min(actor, key=lambda a: abs((a.start - t.start).total_seconds())) if actor else None
        steps = t.steps
        rows.append(
            f"{run}  launch {i + 1}: servers to healthy {'-' if server_s is None else f'{server_s:.0f}'} s; "
            f"actor to ready {_seconds(a.start, a.marks.get('ready')) if a else '-'} s; "
            f"trainer to model built {_seconds(t.start, t.marks.get('built'))} s, to first step "
            f"{_seconds(t.start, t.marks.get('first_step'))} s; {len(steps)} steps in "
            f"{_seconds(t.marks.get('first_step'), t.marks.get('last_step'))} s "
            f"(median step {sorted(steps)[len(steps) // 2] if steps else float('nan'):.1f} s); "
            f"last step to done {_seconds(t.marks.get('last_step'), t.marks.get('done'))} s")
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--glob", default=None, help="run directories matching this pattern (recursive **)")
    args = ap.parse_args(argv)
    runs = list(args.runs) + ([Path(p) for p in sorted(glob.glob(args.glob, recursive=True))] if args.glob else [])
    runs = list({r.resolve(): r for r in runs if (r / "logs").is_dir()}.values())  # pytest's *current links
    if not runs:
        raise SystemExit("no run directory with a logs/ folder given: pass RUN_DIR or --glob PATTERN")
    for run in runs:
        for row in describe(run):
            print(row)


if __name__ == "__main__":
    main()
