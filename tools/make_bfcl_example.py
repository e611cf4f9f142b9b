"""Write examples/data/function_calling_bfcl.jsonl: 20 short real BFCL v4 problems.

    pip install --no-deps bfcl-eval==2026.3.23
    PYTHONPATH=. python tools/make_bfcl_example.py examples/data/function_calling_bfcl.jsonl

Each category's files are converted by tools/prepare_data.py (`convert_file("bfcl", ...)`), then
the shortest problems (prompt plus tool schemas, as JSON) are kept, PICK of each category. BFCL is
Apache-2.0: examples/data/function_calling_bfcl.LICENSE says where the problems come from.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from megatron_apriel.data import load_problems
from megatron_apriel.data.datasets import write_problems
from megatron_apriel.records.rollouts import Problem
from tools.prepare_data import bfcl_data_dir, convert_file

PICK = {"simple_python": 4, "multiple": 3, "parallel": 3, "parallel_multiple": 3, "live_simple": 3,
        "live_multiple": 3, "live_parallel": 1}
"""How many problems of each BFCL v4 category the example keeps."""


def _size(problem: Problem) -> int:
    return len(json.dumps(problem.prompt)) + len(json.dumps(problem.reference["functions"]))


def _tools(problem: Problem) -> tuple[str, ...]:
    return tuple(sorted({name for call in problem.reference["ground_truth"] for name in call}))


def shortest_problems(data: Path, workdir: Path) -> list[Problem]:
    """The PICK shortest problems of each category, converted from the BFCL v4 files in `data`;
    a problem that calls the same functions as one already kept is passed over."""
    chosen: list[Problem] = []
    for category, count in PICK.items():
        out = workdir / f"{category}.jsonl"
        convert_file("bfcl", data / f"BFCL_v4_{category}.json", out,
                     answers=data / "possible_answer" / f"BFCL_v4_{category}.json")
        kept = 0
        for problem in sorted(load_problems(out, domain="function_calling"), key=_size):
            if kept < count and _tools(problem) not in {_tools(p) for p in chosen}:
                chosen.append(problem)
                kept += 1
    return chosen


def main() -> None:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data/function_calling_bfcl.jsonl")
    data = bfcl_data_dir()
    if data is None:
        raise SystemExit("bfcl-eval is not installed: pip install --no-deps bfcl-eval==2026.3.23")
    with tempfile.TemporaryDirectory() as workdir:
        print(dest, write_problems(dest, shortest_problems(data, Path(workdir))))


if __name__ == "__main__":
    main()
