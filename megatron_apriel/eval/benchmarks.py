"""Benchmarks as given on the command line: a name, a public format and a local file.

    --bench aime25:aime:/data/aime_2025.jsonl  --bench gpqa_d:gpqa:/data/gpqa_diamond.csv

Formats: the benchmark converters of `megatron_apriel.data.converters` (``aime``, ``gpqa``,
``mmlu_pro``, ``livecodebench``), ``problems``, our own Problem jsonl/parquet (what
``tools/prepare_data.py`` writes), and ``bfcl_multi_turn``: a BFCL v4 multi-turn category file as
the bfcl-eval wheel ships it (``bfcl_eval/data/BFCL_v4_multi_turn_base.json``, its answers read
from ``possible_answer/`` beside it), each sample an episode of the ``bfcl_multi_turn``
environment (``MULTI_TURN``). Samples per problem default to RECIPE.md section 8's
recommendation for the format (AIME 16, GPQA-D 8, MMLU-Pro 1, LiveCodeBench 4); BFCL's own
evaluation draws one per entry.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatron_apriel.data.datasets import load_problems
from megatron_apriel.data.sources import convert_rows
from megatron_apriel.records.rollouts import Problem

FORMATS: tuple[str, ...] = ("aime", "gpqa", "mmlu_pro", "livecodebench", "problems", "bfcl_multi_turn")
DEFAULT_SAMPLES: dict[str, int] = {"aime": 16, "gpqa": 8, "mmlu_pro": 1, "livecodebench": 4, "problems": 4,
                                   "bfcl_multi_turn": 1}
MULTI_TURN: dict[str, str] = {"bfcl_multi_turn": "bfcl_multi_turn"}
"""Formats whose samples are episodes, and the environment (``envs/``) that runs them."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class FormatOptions:
    """Per-format reading options (part of what defines a benchmark's problems)."""

    gpqa_seed: int = 0
    """Seed of GPQA's per-row option shuffle (recorded in each problem's metadata)."""
    lcb_start: str = "2024-08-01"
    """LiveCodeBench window (v5 of RECIPE.md section 8, as its runner is called: ``--start_date
    2024-08-01 --end_date 2025-02-01``), kept by the runner's rule: ``start <= contest_date <= end``,
    both at 00:00 (``data.converters.lcb_in_window``). Empty: no bound."""
    lcb_end: str = "2025-02-01"
    """End of the LiveCodeBench window (see ``lcb_start``); empty: no bound."""
    max_turns: int = 100
    """Multi-turn formats: model turns of one episode; one stopped there is truncated and scored as
    it is (BFCL's environment also ends a user turn after 20 model turns with calls, as BFCL does)."""
    max_trajectory_tokens: int = 0
    """Multi-turn formats: ids of one episode after its prompt (model and tool ids); 0: the sampling's
    max_tokens."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_trajectory_tokens < 0:
            raise ValueError(f"--max-turns must be >= 1 and --max-trajectory-tokens >= 0, got {self.max_turns} and "
                             f"{self.max_trajectory_tokens}.")


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    format: str
    paths: tuple[Path, ...]
    """Its file, or files read in order (an id already read is skipped: LiveCodeBench's releases
    test.jsonl ... test5.jsonl add up, and a window spans several)."""
    n: int = 0
    """Samples per problem; 0: the format's default (DEFAULT_SAMPLES)."""
    options: FormatOptions = field(default_factory=FormatOptions)

    def __post_init__(self) -> None:
        paths = (self.paths,) if isinstance(self.paths, (str, Path)) else self.paths
        object.__setattr__(self, "paths", tuple(Path(p) for p in paths))
        if not self.paths:
            raise ValueError(f"benchmark {self.name}: no file given.")
        if not _NAME.match(self.name):
            raise ValueError(f"benchmark name {self.name!r}: use letters, digits, '_', '-' or '.' (it names files).")
        if self.format not in FORMATS:
            raise ValueError(f"benchmark {self.name}: unknown format {self.format!r}; use one of {FORMATS}.")
        if self.n < 0:
            raise ValueError(f"benchmark {self.name}: samples per problem must be >= 1, got {self.n}.")

    @property
    def samples(self) -> int:
        return self.n or DEFAULT_SAMPLES[self.format]

    @property
    def environment(self) -> str | None:
        """The environment of a multi-turn format's episodes; None for single-turn formats."""
        return MULTI_TURN.get(self.format)

    @classmethod
    def parse(cls, text: str, options: FormatOptions = FormatOptions()) -> BenchmarkSpec:
        """``NAME:FORMAT:PATH[,PATH...]`` (a path may itself contain ':', not ',')."""
        parts = text.split(":", 2)
        if len(parts) != 3 or not all(parts) or not all(parts[2].split(",")):
            raise ValueError(f"--bench {text!r}: write NAME:FORMAT:PATH[,PATH...], e.g. "
                             f"aime25:aime:/data/aime_2025.jsonl (formats: {', '.join(FORMATS)}).")
        return cls(name=parts[0], format=parts[1], paths=tuple(Path(p) for p in parts[2].split(",")), options=options)

    @property
    def source(self) -> str:
        """Its file(s), as written on the command line."""
        return ",".join(str(p) for p in self.paths)

    def identity(self) -> dict:
        """What defines this benchmark's problems: a resumed evaluation must see the same."""
        o, opts = self.options, {}
        if self.format == "gpqa":
            opts = {"gpqa_seed": o.gpqa_seed}
        elif self.format == "livecodebench":
            opts = {"lcb_start": o.lcb_start, "lcb_end": o.lcb_end}
        elif self.format == "bfcl_multi_turn":
            opts = {"max_turns": o.max_turns, "max_trajectory_tokens": o.max_trajectory_tokens,
                    "answers_sha256": [file_sha256(bfcl_answers_path(p)) for p in self.paths]}
        digests = [file_sha256(p) for p in self.paths]
        return {"format": self.format, "file_sha256": digests[0] if len(digests) == 1 else digests,
                **opts}


def file_sha256(path: Path) -> str:
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file.")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def bfcl_answers_path(questions: Path) -> Path:
    """BFCL's possible answers of a category file: ``possible_answer/<same name>`` beside it."""
    return Path(questions).parent / "possible_answer" / Path(questions).name


def _bfcl_answers(paths: tuple[Path, ...]) -> dict:
    answers = {}
    for path in paths:
        found = bfcl_answers_path(path)
        if not found.is_file():
            raise ValueError(f"{path}: BFCL's possible answers are not at {found} (the wheel's layout, "
                             "bfcl_eval/data/possible_answer/): copy them there.")
        rows = [json.loads(line) for line in found.read_text().splitlines() if line.strip()]
        answers.update({r["id"]: r["ground_truth"] for r in rows})
    return answers


def load_benchmark(spec: BenchmarkSpec) -> list[Problem]:
    """The benchmark's problems; ValueError naming the file (and row) when it cannot be read."""
    for path in spec.paths:
        if not path.is_file():
            raise ValueError(f"benchmark {spec.name}: {path}: no such file.")
    if spec.format == "problems":
        problems = [p for path in spec.paths for p in load_problems(path)]
    else:
        kwargs = {"gpqa": {"seed": spec.options.gpqa_seed},
                  "livecodebench": {"start_date": spec.options.lcb_start, "end_date": spec.options.lcb_end}}
        if spec.format == "bfcl_multi_turn":
            kwargs["bfcl_multi_turn"] = {"answers": _bfcl_answers(spec.paths)}
        problems, _ = convert_rows(spec.format, spec.paths, **kwargs.get(spec.format, {}))
    if not problems:
        raise ValueError(f"benchmark {spec.name}: {spec.source} holds no problem (in the date window, for "
                         "livecodebench: see --lcb-start/--lcb-end).")
    return problems
