"""Load Problem records from local jsonl / parquet files (HF `datasets`), and draw from domain pools.

On-disk row layout (one Problem per row; written by `write_problems` and `tools/prepare_data.py`)::

    {"id": "math-0001", "domain": "math",
     "prompt": [{"role": "user", "content": "..."}],
     "reference": "<JSON text>", "metadata": "<JSON text>"}

`reference` and `metadata` are stored as JSON *text*: Arrow needs one schema per column, and the
references of different problems (test lists, tool schemas, instruction kwargs) have different
shapes; storing them as structs would silently merge their keys.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from megatron_apriel.records.rollouts import DOMAINS, Problem

if TYPE_CHECKING:  # imported where a file is read (~1 s): a dry run that reads none skips it
    import datasets

_COLUMNS = ("id", "domain", "prompt", "reference", "metadata")


def problem_to_row(problem: Problem) -> dict[str, Any]:
    return {"id": problem.id, "domain": problem.domain, "prompt": problem.prompt,
            "reference": json.dumps(problem.reference), "metadata": json.dumps(problem.metadata)}


def row_to_problem(row: dict[str, Any]) -> Problem:
    """Inverse of `problem_to_row`; raises ValueError saying what is wrong with the row."""
    missing = [c for c in _COLUMNS if c not in row]
    if missing:
        raise ValueError(f"missing columns {missing}; a row needs {list(_COLUMNS)}")
    try:
        reference = json.loads(row["reference"])
        metadata = json.loads(row["metadata"]) if row["metadata"] else {}
    except (TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"'reference' and 'metadata' must be JSON text ({err})") from err
    return Problem(id=str(row["id"]), domain=row["domain"], prompt=list(row["prompt"] or []),
                   reference=reference, metadata=metadata)


def write_problems(path: str | Path, problems: Iterable[Problem]) -> int:
    """Write `problems` as jsonl; returns the number written."""
    n = 0
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps(problem_to_row(p)) + "\n")
            n += 1
    return n


def _locate_bad_json_line(path: Path) -> str | None:
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                return f"{path}:{lineno}: invalid JSON ({err})"
    return None


def _load_table(path: Path) -> datasets.Dataset:
    import datasets

    if path.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unsupported file type; use .jsonl or .parquet.")
    try:
        return datasets.Dataset.from_json(str(path), keep_in_memory=True)
    except datasets.exceptions.DatasetGenerationError as err:
        where = _locate_bad_json_line(path)
        raise ValueError(where or f"{path}: cannot be read as JSON lines ({err})") from err


def load_problems(path: str | Path, domain: str | None = None) -> list[Problem]:
    """All Problems of one file; a malformed row raises ValueError naming the file and row (1-based)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file.")
    table = _load_table(path)
    problems = []
    for index, row in enumerate(table):
        try:
            problem = row_to_problem(row)
        except ValueError as err:
            raise ValueError(f"{path}: row {index + 1}: {err}") from err
        if domain is not None and problem.domain != domain:
            raise ValueError(f"{path}: row {index + 1}: domain {problem.domain!r}, expected {domain!r}.")
        problems.append(problem)
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate problem ids; ids must be unique within a file.")
    return problems


class ProblemPools:
    """Problems grouped by domain; `draw` picks uniformly with replacement (RECIPE.md section 3)."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        pools: dict[str, list[Problem]] = defaultdict(list)
        for p in problems:
            pools[p.domain].append(p)
        self._pools = dict(pools)

    @classmethod
    def from_files(cls, paths: Sequence[str | Path]) -> ProblemPools:
        return cls(p for path in paths for p in load_problems(path))

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(d for d in DOMAINS if d in self._pools) + tuple(sorted(set(self._pools) - set(DOMAINS)))

    def size(self, domain: str) -> int:
        return len(self._pools.get(domain, ()))

    def problems(self, domain: str) -> list[Problem]:
        return self._pools.get(domain, [])

    def draw(self, domain: str, rng: random.Random) -> Problem:
        if not self._pools.get(domain):
            raise ValueError(f"no problems for domain {domain!r}; loaded domains: {list(self.domains)}. "
                             "Add a data file for it or drop it from the domain mix.")
        pool = self._pools[domain]
        return pool[rng.randrange(len(pool))]


def training_pools(files: Sequence[str], mix: dict[str, float]) -> ProblemPools:
    """The problems of ``actor.data`` (``files``), checked against the sampler's ``mix``: clear
    errors before anything starts (the launchers' preflight and the actor read them alike)."""
    from megatron_apriel.records.rollouts import EVAL_DOMAINS

    if not files:
        raise ValueError("actor.data is empty: list the problem files (jsonl/parquet) the actor draws from.")
    pools = ProblemPools.from_files(list(files))
    eval_only = [d for d in pools.domains if d in EVAL_DOMAINS]
    if eval_only:
        raise ValueError(f"actor.data ({list(files)}) holds problems of {eval_only}, which only evaluation scores "
                         "(apriel-eval); remove those files from actor.data.")
    empty = [d for d in mix if pools.size(d) == 0]
    if empty:
        raise ValueError(f"domains {empty} have weight > 0 in actor.sampler.weights but no problems in actor.data "
                         f"({list(files)}); add their files or drop them from the mix.")
    return pools
