"""The results file of one benchmark: every scored sample, appended as it finishes.

One JSON line per `SampleRecord`, written with a single ``write`` on a file opened ``O_APPEND``,
so a killed evaluation leaves whole lines plus at most one torn last line. `ResultsFile.load`
ignores such a last line (a line without its newline, or one that does not parse) and cuts it off
the file, so the next append starts a fresh line; a bad line anywhere else is an error naming the
file and line (the file was edited or corrupted, and numbers computed from it would be wrong).
A sample's key is ``(problem_id, sample)``; a key seen twice keeps its first record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megatron_apriel.rollout.types import Outcome, TokenIds

SCHEMA_VERSION = 1


class SampleRecord(BaseModel):
    """One sample of one problem: what was generated and how it scored."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["eval_sample"] = "eval_sample"
    schema_version: Literal[1] = SCHEMA_VERSION
    benchmark: str
    problem_id: str
    sample: int = Field(ge=0)
    """Index of the sample among the problem's n (its sampling seed derives from it)."""
    seed: int
    """The vLLM sampling seed of this sample."""
    prompt_tokens: int = Field(ge=1)
    completion_ids: TokenIds
    """Every generated token id (what budget truncation cuts)."""
    finish_reason: str
    text: str
    """The decoded completion the verifier scored (special tokens skipped, as the actor decodes)."""
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
        line = (record.model_dump_json() + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
