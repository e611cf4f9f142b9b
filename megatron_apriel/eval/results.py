"""The results file of one benchmark: every scored sample, appended as it finishes.

One JSON line per `SampleRecord`, written with a single ``write`` on a file opened ``O_APPEND``,
so a killed evaluation leaves whole lines plus at most one torn last line. `ResultsFile.load`
ignores such a last line (a line without its newline, or one that does not parse) and cuts it off
the file, so the next append starts a fresh line; a bad line anywhere else is an error naming the
file and line (the file was edited or corrupted, and numbers computed from it would be wrong).
A sample's key is ``(problem_id, sample)``; a key seen twice keeps its first record.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import ClassVar, Literal, Optional

import numpy as np
from pydantic import Field, ValidationError

from megatron_apriel.records.base import Record
from megatron_apriel.records.rollouts import Outcome, TokenIds

SCHEMA_VERSION = 2
"""2: ``turns`` (multi-turn samples); version 1 files read as one turn each."""


class SampleRecord(Record):
    """One sample of one problem: what was generated and how it scored."""

    VERSION_FIELD: ClassVar[str] = "schema_version"
    VERSION: ClassVar[int] = SCHEMA_VERSION
    READS: ClassVar[tuple[int, ...]] = (1,)
    MISMATCH: ClassVar[str] = "evaluate again into a new output directory, or read it with the version that wrote it."
    kind: Literal["eval_sample"] = "eval_sample"
    schema_version: int = SCHEMA_VERSION
    benchmark: str
    problem_id: str
    sample: int = Field(ge=0)
    """Index of the sample among the problem's n (its sampling seed derives from it)."""
    seed: int
    """The vLLM sampling seed of this sample."""
    prompt_tokens: int = Field(ge=1)
    completion_ids: TokenIds
    """Every generated token id (what budget truncation cuts); a multi-turn sample's ids after its
    prompt: its model turns as sampled, with the environment's template ids between them."""
    finish_reason: str
    """A multi-turn sample stopped by a limit (turns, tokens, a turn cut at its length) has "length"."""
    text: str
    """The decoded completion the verifier scored (special tokens skipped, as the actor decodes); a
    multi-turn sample's whole trajectory, decoded once for reading (its episode scored each turn)."""
    turns: int = Field(default=1, ge=1)
    """Model turns."""
    outcome: Outcome
    success: bool
    score: float = Field(ge=0.0, le=1.0)
    detail: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return self.problem_id, self.sample

    @property
    def length(self) -> int:
        return len(self.completion_ids)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class ResultsFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self, repair: bool = True) -> dict[tuple[str, int], SampleRecord]:
        """The records written so far; a torn last line is ignored, and cut off the file when
        ``repair`` (the writer does so before appending; readers of a live file must not)."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        complete, tail = lines[:-1], lines[-1]  # tail: bytes after the last newline (b"" if none)
        records: dict[tuple[str, int], SampleRecord] = {}
        keep = len(data) - len(tail)
        for lineno, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                record = SampleRecord.model_validate(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError, ValidationError) as err:
                if lineno == len(complete) and not tail:
                    keep -= len(line) + 1  # the last line, torn after its newline was never written
                    break
                raise ValueError(f"{self.path}:{lineno}: not a sample record ({str(err)[:300]}); the file was "
                                 "edited or corrupted: remove that line or the file (its samples are redone).") from err
            records.setdefault(record.key, record)
        if repair and keep != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)
        return records

    def append(self, record: SampleRecord) -> None:
        append_line(self.path, record.model_dump_json())


def append_line(path: Path, text: str) -> None:
    """``text`` and a newline at the end of ``path``, in O_APPEND writes (a kill leaves at most a
    torn last line, which the readers ignore)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview((text + "\n").encode())
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


class BudgetVerdicts:
    """Verdicts of traces cut at a token budget, kept next to the samples so that a report (a rerun,
    a resumed evaluation) rescores only what it has not scored before: rescoring LiveCodeBench at
    five budgets runs the code sandbox on every cut trace. Keyed by the cut trace itself (problem,
    sample, budget and a digest of its tokens), so a sample that was redone is scored anew."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._known: dict[tuple, bool] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line: that verdict is computed again
                self._known[(row["problem_id"], row["sample"], row["budget"], row["trace"])] = row["success"]

    @staticmethod
    def key(record: SampleRecord, budget: int) -> tuple:
        trace = hashlib.sha256(np.asarray(record.completion_ids[:budget], dtype="<i4").tobytes()).hexdigest()[:16]
        return record.problem_id, record.sample, budget, trace

    def get(self, record: SampleRecord, budget: int) -> Optional[bool]:
        return self._known.get(self.key(record, budget))

    def add(self, record: SampleRecord, budget: int, success: bool) -> None:
        key = self.key(record, budget)
        self._known[key] = success
        append_line(self.path, json.dumps({"problem_id": key[0], "sample": key[1], "budget": key[2],
                                           "trace": key[3], "success": success}))
