"""The judge's answer, checked: a segmentation is accepted only if it is exactly right.

Accepted: one JSON object (bare, or alone in a fenced ```json block) ``{"steps": [{"text": str,
"label": str, "summary"?: str}, ...]}`` with at least one step, no empty step text, the texts
joined equal to the window character for character, and each label one of `prompts.LABELS`
(compared after lower-casing and turning spaces and hyphens into underscores: "Forward
reasoning" is ``forward_reasoning``; a list or any other name is refused). Nothing is repaired:
anything else is a `Rejection` naming its kind and what was wrong, which the judge is shown on
its next attempt.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from megatron_apriel.eval.steps.prompts import LABELS


class Failure(str, enum.Enum):
    """Why a window has no accepted segmentation (the report counts each)."""

    MALFORMED = "malformed_json"
    """Not one JSON object of the required shape."""
    NOT_VERBATIM = "not_verbatim"
    """The steps, joined, are not the trace character for character."""
    BAD_LABEL = "bad_label"
    """A step without exactly one of the eight labels."""
    TIMEOUT = "timeout"
    """The judge did not answer within the client's timeout."""
    JUDGE_ERROR = "judge_error"
    """The request failed: connection refused, HTTP error status, no message in the response."""
    TOO_LONG = "too_long"
    """Longer than a judge window, with no step-safe boundary to cut it at (`windows.py`)."""

    @property
    def transient(self) -> bool:
        """A failure of the transport, not a verdict: never cached, asked again by a rerun."""
        return self in (Failure.TIMEOUT, Failure.JUDGE_ERROR)


@dataclass(frozen=True)
class Rejection:
    kind: Failure
    detail: str

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}"


@dataclass(frozen=True)
class Step:
    text: str
    label: str
    summary: str = ""


_FENCE = re.compile(r"^```[a-zA-Z]*\n(.*)\n```$", re.DOTALL)


def _normal_label(label: str) -> str:
    return re.sub(r"[\s\-]+", "_", label.strip().lower())


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_verbatim(texts: list[str], window: str) -> Rejection | None:
    joined = "".join(texts)
    if joined == window:
        return None
    at = _first_difference(joined, window)
    return Rejection(Failure.NOT_VERBATIM, f"the steps joined ({len(joined)} characters) differ from the trace "
                                           f"({len(window)} characters) at character {at}: trace "
                                           f"{window[at:at + 30]!r}, steps {joined[at:at + 30]!r}")


def _parse_steps(content: str) -> list[dict] | Rejection:
    text = content.strip()
    fenced = _FENCE.match(text)
    try:
        data = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError as err:
        return Rejection(Failure.MALFORMED, f"not JSON ({err}); the answer began {text[:60]!r}")
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list) or not steps:
        return Rejection(Failure.MALFORMED, 'no non-empty "steps" list in the JSON object')
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or not isinstance(step.get("text"), str) or not step["text"]:
            return Rejection(Failure.MALFORMED, f'step {i} has no non-empty "text" string')
    return steps


def check_answer(content: str, window: str) -> list[Step] | Rejection:
    """The accepted steps of ``window`` in the judge's answer ``content``, or why it is refused."""
    steps = _parse_steps(content)
    if isinstance(steps, Rejection):
        return steps
    wrong = check_verbatim([s["text"] for s in steps], window)
    if wrong is not None:
        return wrong
    out = []
    for i, step in enumerate(steps):
        label = step.get("label")
        if not isinstance(label, str) or _normal_label(label) not in LABELS:
            return Rejection(Failure.BAD_LABEL, f"step {i} has label {label!r}, not exactly one of {list(LABELS)}")
        summary = step.get("summary")
        out.append(Step(text=step["text"], label=_normal_label(label), summary=summary if isinstance(summary, str)
                        else ""))
    return out
