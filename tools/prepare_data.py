"""Convert the paper's source datasets (local files) into our Problem jsonl.

    python tools/prepare_data.py orz      orz_math_57k_collected.json       data/math.jsonl
    python tools/prepare_data.py taco     taco_train.jsonl                  data/code_taco.jsonl
    python tools/prepare_data.py apps     apps_train.jsonl                  data/code_apps.jsonl
    python tools/prepare_data.py i3_logic intellect3_logic.parquet          data/logic.jsonl
    python tools/prepare_data.py if_multi if_multi_constraints.parquet      data/ifeval.jsonl
    python tools/prepare_data.py bfcl     $BFCL/BFCL_v4_simple_python.json  data/fc.jsonl \
        --answers $BFCL/possible_answer/BFCL_v4_simple_python.json
    python tools/prepare_data.py bfcl_multi_turn $BFCL/BFCL_v4_multi_turn_base.json data/fc_multi_turn.jsonl \
        --answers $BFCL/possible_answer/BFCL_v4_multi_turn_base.json

Evaluation benchmarks (apriel-eval also reads these formats directly):

    python tools/prepare_data.py aime          aime_2025.jsonl          eval/aime25.jsonl
    python tools/prepare_data.py gpqa          gpqa_diamond.csv         eval/gpqa_d.jsonl --seed 0
    python tools/prepare_data.py mmlu_pro      mmlu_pro_test.parquet    eval/mmlu_pro.jsonl
    python tools/prepare_data.py livecodebench test.jsonl test2.jsonl test3.jsonl test4.jsonl test5.jsonl \
        eval/lcb_v5.jsonl --start-date 2024-08-01 --end-date 2025-02-01

LiveCodeBench's release files add up (test5.jsonl holds only the problems new in v5; v5's window
also has problems of test4.jsonl): give every file up to the release, in order. A question id read
from an earlier file is skipped (counted); the window follows the official runner
(start <= contest_date <= end, at 00:00).

BFCL v4 ships in the bfcl-eval wheel: `pip install --no-deps bfcl-eval==2026.3.23`, then
`BFCL=$(python -c "from tools.prepare_data import bfcl_data_dir; print(bfcl_data_dir())")`.

Inputs are local files (download them beforehand); .json holding a list, .jsonl, .parquet and .csv are read;
several input files (before the output) are read in order, as one.
Skipped rows are counted by reason; a malformed row stops the run with its file and row number.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections import Counter
from pathlib import Path
from typing import Any

from megatron_apriel.data.converters import CONVERTERS
from megatron_apriel.data.datasets import write_problems
from megatron_apriel.data.sources import convert_rows, read_rows


def bfcl_data_dir() -> Path | None:
    """The BFCL v4 files of the installed bfcl-eval wheel (`bfcl_eval/data`); None without it."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "data"


def convert_file(fmt: str, src: Path | list[Path], out: Path, answers: Path | None = None, max_tests: int = 5,
                 seed: int = 0, start_date: str = "", end_date: str = "") -> Counter:
    """Convert `src` (one file or several, in order) into `out`; returns counts of written rows and of skip reasons."""
    kwargs: dict[str, Any] = {}
    if fmt in ("bfcl", "bfcl_multi_turn"):
        if answers is None:
            raise ValueError(f"{fmt} needs --answers: the possible_answer file of the same category.")
        kwargs["answers"] = {r["id"]: r["ground_truth"] for r in read_rows(answers)}
    if fmt in ("taco", "apps"):
        kwargs["max_tests"] = max_tests
    if fmt == "gpqa":
        kwargs["seed"] = seed
    if fmt == "livecodebench":
        kwargs.update(start_date=start_date, end_date=end_date)
    problems, stats = convert_rows(fmt, src, **kwargs)
    stats["written"] = write_problems(out, problems)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("format", choices=sorted(CONVERTERS))
    parser.add_argument("src", type=Path, nargs="+", help="input file(s), read in order")
    parser.add_argument("out", type=Path)
    parser.add_argument("--answers", type=Path, help="BFCL possible_answer file (bfcl only)")
    parser.add_argument("--max-tests", type=int, default=5, help="tests kept per code problem (taco/apps; recipe: 5)")
    parser.add_argument("--seed", type=int, default=0, help="gpqa: seed of the per-row option shuffle (recorded)")
    parser.add_argument("--start-date", default="",
                        help="livecodebench: start <= contest_date, at 00:00 (v5: 2024-08-01)")
    parser.add_argument("--end-date", default="", help="livecodebench: contest_date <= end, at 00:00 (v5: 2025-02-01)")
    args = parser.parse_args()
    stats = convert_file(args.format, args.src, args.out, args.answers, args.max_tests, args.seed, args.start_date,
                         args.end_date)
    for key, count in sorted(stats.items()):
        print(f"{key}: {count}")


if __name__ == "__main__":
    main()
