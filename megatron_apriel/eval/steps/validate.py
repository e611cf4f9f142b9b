"""The judge's answer, checked: a segmentation is accepted only if it is the trace's own steps.

Accepted: one JSON object ``{"steps": [...]}`` anywhere in the answer (bare, fenced, before or
after prose; a reasoning model's ``<think>...</think>`` is dropped first; the same object twice
counts once), with at least one step, each step a dict with a non-empty string under the mode's
key (copy: ``text``, the step's full text; boundaries: ``start``, its first words) and each label
one of `prompts.LABELS` (compared after lower-casing and turning spaces and hyphens into
underscores: "Forward reasoning" is ``forward_reasoning``; a list or any other name is refused).
The steps are then placed in the trace with whitespace forgiven (`align.py`) and cut from the
trace itself. Nothing else is repaired: no object, two different ones, characters other than
whitespace missing, added or changed, a start missing or ambiguous, is a `Rejection` naming its
kind and what was wrong, which the judge is shown on its next attempt.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from megatron_apriel.eval.steps.align import align_texts, find_starts
from megatron_apriel.eval.steps.prompts import LABELS, MODES


class Failure(str, enum.Enum):
    """Why a window has no accepted segmentation (the report counts each)."""

    MALFORMED = "malformed_json"
    """Not one JSON object of the required shape."""
    NOT_VERBATIM = "not_verbatim"
    """Copy mode: the steps, joined, are not the trace (whitespace aside)."""
    BAD_BOUNDARY = "bad_boundary"
    """Boundaries mode: a step's start is not in the trace, or is ambiguous."""
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


_THINK = re.compile(r"^.*</think>", re.DOTALL)


def _normal_label(label: str) -> str:
    return re.sub(r"[\s\-]+", "_", label.strip().lower())


def check_verbatim(texts: list[str], window: str) -> Rejection | None:
    """None if ``texts`` joined are ``window`` exactly (a cached verdict, whose texts are cut from it)."""
    joined = "".join(texts)
    if joined == window:
        return None
    at = next((i for i, (x, y) in enumerate(zip(joined, window)) if x != y), min(len(joined), len(window)))
    return Rejection(Failure.NOT_VERBATIM, f"the steps joined ({len(joined)} characters) differ from the trace "
                                           f"({len(window)} characters) at character {at}: trace "
                                           f"{window[at:at + 30]!r}, steps {joined[at:at + 30]!r}")


def _objects(text: str) -> tuple[list[dict], str]:
    """The JSON objects in ``text`` not nested in another, and the error at the first ``{`` that begins none."""
    decoder, found, error = json.JSONDecoder(), [], ""
    at = text.find("{")
    while at >= 0:
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as err:
            error, end = error or str(err), at + 1
        else:
            found += [obj] if isinstance(obj, dict) else []
        at = text.find("{", end)
    return found, error


def _parse_steps(content: str, key: str) -> list[dict] | Rejection:
    text = _THINK.sub("", content, count=1).strip()
    objects, error = _objects(text)
    answers = {json.dumps(o, sort_keys=True): o for o in objects if "steps" in o}
    if not answers:
        why = f"not JSON ({error})" if error else "no JSON object"
        return Rejection(Failure.MALFORMED, f'{why}: no object with a "steps" list; the answer began {text[:60]!r}')
    if len(answers) > 1:
        return Rejection(Failure.MALFORMED, f'{len(answers)} different JSON objects with "steps" in the answer: '
                                            "give exactly one")
    steps = next(iter(answers.values()))["steps"]
    if not isinstance(steps, list) or not steps:
        return Rejection(Failure.MALFORMED, 'no non-empty "steps" list in the JSON object')
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or not isinstance(step.get(key), str) or not step[key]:
            return Rejection(Failure.MALFORMED, f'step {i} has no non-empty "{key}" string')
    return steps


def check_answer(content: str, window: str, mode: str = "copy") -> list[Step] | Rejection:
    """The accepted steps of ``window`` in the judge's answer ``content`` (in ``mode``, one of
    `prompts.MODES`), or why it is refused."""
    assert mode in MODES, mode
    key = "text" if mode == "copy" else "start"
    steps = _parse_steps(content, key)
    if isinstance(steps, Rejection):
        return steps
    cuts = (align_texts if mode == "copy" else find_starts)([s[key] for s in steps], window)
    if isinstance(cuts, str):
        return Rejection(Failure.NOT_VERBATIM if mode == "copy" else Failure.BAD_BOUNDARY, cuts)
    out = []
    for i, (step, a, b) in enumerate(zip(steps, cuts, cuts[1:] + [len(window)])):
        label = step.get("label")
        if not isinstance(label, str) or _normal_label(label) not in LABELS:
            return Rejection(Failure.BAD_LABEL, f"step {i} has label {label!r}, not exactly one of {list(LABELS)}")
        summary = step.get("summary")
        out.append(Step(text=window[a:b], label=_normal_label(label),
                        summary=summary if isinstance(summary, str) else ""))
    return out
