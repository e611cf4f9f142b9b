"""Rows of source files in their public formats, and their conversion into Problem records.

Read here: ``.json`` holding a list, ``.jsonl`` (JSON lines), ``.parquet`` and ``.csv`` (header
row first). `convert_rows` is what ``tools/prepare_data.py`` and ``apriel-eval`` share: a row the
recipe leaves out is counted by reason, a malformed row stops with the file and row (1-based).
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Sequence

from megatron_apriel.data.converters import CONVERTERS, SkipRow
from megatron_apriel.records.rollouts import Problem

SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")


def read_rows(path: Path) -> Iterator[dict | list]:
    """The rows of ``path``, in file order; ValueError for an unknown suffix, a missing file or bad JSON."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file.")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {SUFFIXES}.")
    if path.suffix == ".parquet":
        import datasets

        yield from datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
        return
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            yield from csv.DictReader(f)
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


def convert_rows(fmt: str, src: Path | Sequence[Path], **kwargs: Any) -> tuple[list[Problem], Counter]:
    """Every row of ``src`` (one file, or several in order) through ``CONVERTERS[fmt]``; returns the
    problems and the skip counts. A problem id already read from an earlier file is skipped (and
    counted): releases such as LiveCodeBench's ``test.jsonl`` ... ``test5.jsonl`` add up, and a window
    may span several of them."""
    srcs = [Path(src)] if isinstance(src, (str, Path)) else [Path(s) for s in src]
    problems, skipped, seen = [], Counter(), set()
    for path in srcs:
        found, counts = _convert_file(fmt, path, **kwargs)
        skipped.update(counts)
        for p in found:
            if p.id in seen:
                skipped["skipped: duplicate id (in an earlier file)"] += 1
            else:
                seen.add(p.id)
                problems.append(p)
    return problems, skipped


def _convert_file(fmt: str, src: Path, **kwargs: Any) -> tuple[list[Problem], Counter]:
    if fmt not in CONVERTERS:
        raise ValueError(f"unknown source format {fmt!r}; known: {sorted(CONVERTERS)}.")
    problems, skipped = [], Counter()
    for index, row in enumerate(read_rows(src)):
        try:
            problems.append(CONVERTERS[fmt](row, index, **kwargs))
        except SkipRow as reason:
            skipped[f"skipped: {reason}"] += 1
        except (KeyError, ValueError, TypeError, SyntaxError, IndexError) as err:
            raise ValueError(f"{src}: row {index + 1}: not in {fmt} format ({type(err).__name__}: {err})") from err
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"{src}: duplicate problem ids {dup}; ids must be unique within a file.")
    return problems, skipped
