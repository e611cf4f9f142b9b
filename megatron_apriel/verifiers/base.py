"""Verifier contract: a result type whose outcome tells model failures from verifier failures.

A verifier is any object with a `domain` name and `verify(problem, completion) -> VerifierResult`.
It must raise (not return) when *it* breaks; `run_verifier` is the one place that turns such an
exception into `Outcome.VERIFIER_ERROR`, so that a crash is never counted against the model.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from typing import Protocol

from megatron_apriel.records.rollouts import Outcome, Problem

BEGIN_FINAL = "[BEGIN FINAL RESPONSE]"
END_FINAL = "[END FINAL RESPONSE]"


@dataclass(frozen=True)
class VerifierResult:
    """score in [0, 1] (partial credit allowed); success = the task is fully solved."""

    score: float
    success: bool
    outcome: Outcome
    detail: str = ""

    def __post_init__(self) -> None:
        assert 0.0 <= self.score <= 1.0, f"score {self.score} outside [0, 1]"
        assert not self.success or self.outcome is Outcome.CORRECT, "success requires outcome CORRECT"

    @property
    def is_model_failure(self) -> bool:
        return self.outcome not in (Outcome.CORRECT, Outcome.VERIFIER_ERROR)


def correct(detail: str = "") -> VerifierResult:
    return VerifierResult(1.0, True, Outcome.CORRECT, detail)


def failed(outcome: Outcome, detail: str = "", score: float = 0.0) -> VerifierResult:
    """A result that is not fully solved; `score` > 0 only for partial credit."""
    assert outcome is not Outcome.CORRECT
    return VerifierResult(score, False, outcome, detail)


class Verifier(Protocol):
    """One domain's scorer. `verify` raises on internal errors; it never returns them disguised."""

    domain: str

    def verify(self, problem: Problem, completion: str) -> VerifierResult: ...


def extract_final_response(text: str) -> str:
    """The answer part of an Apriel completion.

    The text after the last `[BEGIN FINAL RESPONSE]` up to the next `[END FINAL RESPONSE]` (or the
    end of the text when the end marker is missing, e.g. it was the stop string); the whole text,
    stripped, when there is no begin marker.
    """
    start = text.rfind(BEGIN_FINAL)
    if start < 0:
        body = text
    else:
        body = text[start + len(BEGIN_FINAL):]
    end = body.find(END_FINAL)
    if end >= 0:
        body = body[:end]
    return body.strip()


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """Drop `<think>...</think>` blocks (for non-Apriel models) before answer extraction."""
    return _THINK.sub("", text)


def run_verifier(verifier: Verifier, problem: Problem, completion: str) -> VerifierResult:
    """Call `verifier.verify`, mapping an exception raised by the verifier to VERIFIER_ERROR.

    This is the single boundary where exceptions are caught; the traceback's last lines go into
    `detail` so that the failure can be diagnosed from the rollout logs.
    """
    try:
        return verifier.verify(problem, completion)
    except Exception as err:  # the one boundary: verifier bugs must not count as model failures
        tail = "".join(traceback.format_exception(err)[-3:])
        return failed(Outcome.VERIFIER_ERROR, f"{type(err).__name__}: {err}\n{tail}"[:2000])
