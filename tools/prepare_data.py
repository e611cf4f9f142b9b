"""Convert the paper's source datasets (local files) into our Problem jsonl.

    python tools/prepare_data.py orz      orz_math_57k_collected.json       data/math.jsonl
    python tools/prepare_data.py taco     taco_train.jsonl                  data/code_taco.jsonl
    python tools/prepare_data.py apps     apps_train.jsonl                  data/code_apps.jsonl
    python tools/prepare_data.py i3_logic intellect3_logic.parquet          data/logic.jsonl
    python tools/prepare_data.py if_multi if_multi_constraints.parquet      data/ifeval.jsonl
    python tools/prepare_data.py bfcl     $BFCL/BFCL_v4_simple_python.json  data/fc.jsonl \
        --answers $BFCL/possible_answer/BFCL_v4_simple_python.json

BFCL v4 ships in the bfcl-eval wheel: `pip install --no-deps bfcl-eval==2026.3.23`, then
`BFCL=$(python -c "from tools.prepare_data import bfcl_data_dir; print(bfcl_data_dir())")`.

Inputs are local files (download them beforehand); .json holding a list, .jsonl and .parquet are read.
Skipped rows are counted by reason; a malformed row stops the run with its file and row number.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import datasets

from megatron_apriel.data.converters import CONVERTERS, SkipRow
from megatron_apriel.data.datasets import write_problems


def bfcl_data_dir() -> Path | None:
    """The BFCL v4 files of the installed bfcl-eval wheel (`bfcl_eval/data`); None without it."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "data"


def read_rows(path: Path) -> Iterator[dict | list]:
    if path.suffix == ".parquet":
        yield from datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
        return
    text = path.read_text()
    if text.lstrip().startswith("["):
        yield from json.loads(text)
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({err})") from err


def convert_file(fmt: str, src: Path, out: Path, answers: Path | None = None, max_tests: int = 5) -> Counter:
    """Convert `src` into `out`; returns counts of written rows and of skip reasons."""
    kwargs: dict[str, Any] = {}
    if fmt == "bfcl":
        if answers is None:
            raise ValueError("bfcl needs --answers: the possible_answer file of the same category.")
        kwargs["answers"] = {r["id"]: r["ground_truth"] for r in read_rows(answers)}
    if fmt in ("taco", "apps"):
        kwargs["max_tests"] = max_tests
    stats: Counter = Counter()

    def problems():
        for index, row in enumerate(read_rows(src)):
            try:
                yield CONVERTERS[fmt](row, index, **kwargs)
            except SkipRow as reason:
                stats[f"skipped: {reason}"] += 1
            except (KeyError, ValueError, TypeError, SyntaxError) as err:
                raise ValueError(f"{src}: row {index + 1}: not in {fmt} format ({type(err).__name__}: {err})") from err
    stats["written"] = write_problems(out, problems())
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("format", choices=sorted(CONVERTERS))
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--answers", type=Path, help="BFCL possible_answer file (bfcl only)")
    parser.add_argument("--max-tests", type=int, default=5, help="tests kept per code problem (recipe: 5)")
    args = parser.parse_args()
    for key, count in sorted(convert_file(args.format, args.src, args.out, args.answers, args.max_tests).items()):
        print(f"{key}: {count}")


if __name__ == "__main__":
    main()
