"""The judge's verdicts, cached one file per window so that a rerun asks only for what is new.

Layout: ``EVAL/steps/cache/<digest>.json``, one `Verdict` each, with ``digest`` the SHA-256
of (window text, prompts version and fingerprint, judge model name) (`verdict_digest`): the same
text judged by the same model under the same prompts is asked once, whatever benchmark or sample
it came from; another prompt version or judge is another file. A verdict is written with
`files.atomic_write` (temporary name, fsync, rename), so a SIGKILL leaves a whole file or none
(at most a hidden ``.<name>.tmp-<pid>``, which readers ignore). Cached are the accepted
segmentations and those refused after every attempt (the judge's verdict, which a rerun would only
repeat; ``--retry-failed`` asks again); timeouts and transport errors are not verdicts and are
never cached. A cached segmentation is checked against its window again when read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from megatron_apriel.eval.steps.prompts import Prompts
from megatron_apriel.eval.steps.validate import Failure, Rejection, Step, check_verbatim
from megatron_apriel.files import atomic_write
from megatron_apriel.records.base import Record


def verdict_digest(window: str, prompts: Prompts, judge: str) -> str:
    key = json.dumps({"trace": window, "prompts_version": prompts.version, "prompts_fingerprint": prompts.fingerprint,
                      "judge": judge}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


class CachedStep(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    text: str
    label: str
    summary: str = ""


class Verdict(Record):
    """The judge's last word on one window: its accepted steps, or why it was refused."""

    VERSION_FIELD: ClassVar[str] = "schema_version"
    VERSION: ClassVar[int] = 1
    MISMATCH: ClassVar[str] = "delete EVAL/steps/cache to judge again with this version."
    kind: Literal["steps_verdict"] = "steps_verdict"
    schema_version: int = 1
    digest: str
    prompts_version: int
    judge: str
    attempts: int
    steps: list[CachedStep] = []
    failure: Optional[Failure] = None
    detail: str = ""

    def result(self) -> list[Step] | Rejection:
        if self.failure is not None:
            return Rejection(self.failure, self.detail)
        return [Step(text=s.text, label=s.label, summary=s.summary) for s in self.steps]


class VerdictCache:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, digest: str) -> Path:
        return self.directory / f"{digest}.json"

    def get(self, digest: str, window: str) -> Optional[Verdict]:
        """The cached verdict of ``window``, or None; ValueError naming a file that is not one."""
        path = self.path(digest)
        if not path.is_file():
            return None
        try:
            verdict = Verdict.model_validate(json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError, ValidationError) as err:
            raise ValueError(f"{path}: not a cached verdict ({str(err)[:200]}); delete it to judge that trace again.") \
                from err
        wrong = None if verdict.failure else check_verbatim([s.text for s in verdict.steps], window)
        if verdict.digest != digest or wrong is not None:
            raise ValueError(f"{path}: holds the verdict of another trace ({wrong or 'digest ' + verdict.digest}); "
                             "delete it to judge that trace again.")
        return verdict

    def put(self, verdict: Verdict) -> None:
        assert verdict.failure is None or not verdict.failure.transient, "transport failures are not verdicts"
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path(verdict.digest), verdict.model_dump_json(indent=1))
