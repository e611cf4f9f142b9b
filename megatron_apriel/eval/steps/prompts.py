"""The eight step labels and the judge's versioned prompts (``prompts_v<N>.yaml`` beside this file).

The labels are the report's keys (RECIPE.md section 11); the prompts file must describe exactly
these eight, in this order, or it is refused. Its ``version`` is part of every cached verdict's
digest and of the report, so a reworded prompt never reuses a verdict of the old wording; so is a
fingerprint of the text itself, in case a file is edited without a new version. ``--judge-prompts``
reads another file of the same shape (a judge with a short context, another wording).

A prompts file also names its answer ``mode`` (`MODES`; ``copy`` when the key is absent, as in
v1): ``copy``, the judge writes each step's full text back; ``boundaries`` (v2, the default), the
judge quotes each step's first words only and the tool cuts the trace there (`align.py`), a
fraction of the output tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import yaml

LABELS: tuple[str, ...] = ("problem_setup", "forward_reasoning", "verification", "backtracking", "subgoal_setting",
                           "backward_chaining", "final_answer", "other")
NON_PRODUCTIVE = "other"
"""The label of steps that add nothing (the paper's non-productive share: 21% -> 14%)."""
STRATEGIC: tuple[str, ...] = ("verification", "backtracking", "subgoal_setting", "backward_chaining")
"""The labels whose combined share the paper reports (11% -> 17%)."""

MODES: tuple[str, ...] = ("boundaries", "copy")
PROMPTS_FILES: dict[str, Path] = {"boundaries": Path(__file__).with_name("prompts_v2.yaml"),
                                  "copy": Path(__file__).with_name("prompts_v1.yaml")}
"""The packaged prompts of each mode (``--judge-mode``)."""
PROMPTS_FILE = PROMPTS_FILES["boundaries"]


@dataclass(frozen=True)
class Prompts:
    """The judge's instructions: one system message (segmentation, classification, answer format)
    and the follow-up sent with a rejected answer's reason."""

    version: int
    system: str
    retry: str
    source: str = str(PROMPTS_FILE)
    mode: str = "copy"
    """How the judge gives the steps (`MODES`)."""

    @property
    def fingerprint(self) -> str:
        """The first 12 hex digits of the SHA-256 of the texts sent to the judge (and of the mode,
        unless it is ``copy``: v1's fingerprints are unchanged)."""
        text = self.system + "\0" + self.retry + ("" if self.mode == "copy" else "\0" + self.mode)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def retry_message(self, reason: str) -> str:
        return self.retry.replace("{reason}", reason)


def load_prompts(path: Path = PROMPTS_FILE) -> Prompts:
    """The prompts in ``path``; ValueError naming the file and what is wrong with it."""
    if not Path(path).is_file():
        raise ValueError(f"prompts file {path}: no such file; copy {PROMPTS_FILE} and edit the copy.")
    data = yaml.safe_load(Path(path).read_text())
    need = ("version", "labels", "segmentation", "classification", "answer_format", "retry")
    missing = [k for k in need if not isinstance(data, dict) or k not in data]
    if missing:
        raise ValueError(f"{path}: missing keys {missing}; a prompts file has {list(need)}.")
    if tuple(data["labels"]) != LABELS:
        raise ValueError(f"{path}: labels {list(data['labels'])} are not the eight of RECIPE.md section 11, "
                         f"in order: {list(LABELS)}.")
    if not isinstance(data["version"], int) or data["version"] < 1:
        raise ValueError(f"{path}: version must be a positive integer, got {data['version']!r}.")
    mode = data.get("mode", "copy")
    if mode not in MODES:
        raise ValueError(f"{path}: mode {mode!r} is not one of {list(MODES)} (absent: copy).")
    labels = "\n".join(f"- {name}: {meaning}" for name, meaning in data["labels"].items())
    system = "\n".join([data["segmentation"].strip(), data["classification"].replace("{labels}", labels).strip(),
                        data["answer_format"].strip()])
    return Prompts(version=data["version"], system=system, retry=data["retry"].strip(), source=str(path),
                   mode=mode)
