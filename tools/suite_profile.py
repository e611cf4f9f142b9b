"""The suite's cost per module: wall seconds, CPU seconds of the whole machine meanwhile, the cores
used on average, and the idle core-seconds a parallel run could fill. Reads what the pytest plugin
``tests/cpu_profile.py`` wrote.

    APRIEL_SUITE_PROFILE=runs/profile.jsonl CI=true python -m pytest -p tests.cpu_profile
    python -m tools.suite_profile runs/profile.jsonl [--top 25] [--markdown]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Cost:
    wall_s: float = 0.0
    cpu_s: float = 0.0
    own_cpu_s: float = 0.0

    def add(self, wall_s: float, cpu_s: float, own_cpu_s: float = 0.0) -> None:
        self.wall_s += wall_s
        self.cpu_s += cpu_s
        self.own_cpu_s += own_cpu_s


def read_rows(path: Path) -> tuple[list[dict], int]:
    """The phase rows of ``path`` and the machine's cores."""
    if not path.exists():
        raise SystemExit(f"no profile at {path}: run pytest with APRIEL_SUITE_PROFILE={path} "
                         "(pytest.ini loads tests/cpu_profile.py)")
    rows, cores = [], 1
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "session_start" in row:
            cores = row["cores"]
        else:
            rows.append(row)
    return rows, cores


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def table(rows: list[dict], cores: int, key, top: int) -> list[tuple[str, Cost]]:
    costs: dict[str, Cost] = defaultdict(Cost)
    for r in rows:
        costs[key(r)].add(r["wall_s"], r["cpu_s"], r.get("own_cpu_s", 0.0))
    return sorted(costs.items(), key=lambda kv: -kv[1].wall_s)[:top]


def render(title: str, items: list[tuple[str, Cost]], cores: int, markdown: bool) -> str:
    head = ("what", "wall s", "cpu s", "cores used", "idle core-s", "own cpu s")
    lines = [f"## {title}" if markdown else title]
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append(f"{head[0]:<90} {head[1]:>8} {head[2]:>8} {head[3]:>10} {head[4]:>11} {head[5]:>9}")
    for name, c in items:
        used = c.cpu_s / c.wall_s if c.wall_s else 0.0
        idle = max(0.0, cores * c.wall_s - c.cpu_s)
        cells = (name, f"{c.wall_s:.0f}", f"{c.cpu_s:.0f}", f"{used:.2f}", f"{idle:.0f}", f"{c.own_cpu_s:.0f}")
        lines.append("| " + " | ".join(cells) + " |" if markdown else
                     f"{cells[0]:<90} {cells[1]:>8} {cells[2]:>8} {cells[3]:>10} {cells[4]:>11} {cells[5]:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=25, help="how many phases in the slowest-phases table")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    rows, cores = read_rows(args.profile)
    start = min(r["start"] for r in rows)
    end = max(r["start"] + r["wall_s"] for r in rows)
    total = Cost()
    for r in rows:
        total.add(r["wall_s"], r["cpu_s"], r.get("own_cpu_s", 0.0))
    print(f"{len({r['nodeid'] for r in rows})} tests, {cores} cores: {end - start:.0f} s from the first phase's "
          f"start to the last one's end; phases add up to {total.wall_s:.0f} s wall and {total.cpu_s:.0f} CPU-s "
          f"({total.cpu_s / max(total.wall_s, 1e-9):.2f} cores used)")
    print()
    print(render("per module (setup + call + teardown)", table(rows, cores, lambda r: module_of(r["nodeid"]), 200),
                 cores, args.markdown))
    print()
    print(render(f"the {args.top} slowest phases", table(rows, cores, lambda r: f"{r['when']} {r['nodeid']}",
                                                        args.top), cores, args.markdown))


if __name__ == "__main__":
    main()
