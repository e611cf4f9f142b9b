"""Math verifier: math-verify on the last `\\boxed{}` of the final response (RECIPE.md section 6).

Reference: the gold answer as a LaTeX or plain string, e.g. "\\frac{1}{2}" or "0.5".
Equivalent forms (1/2, 0.5, \\frac{1}{2}, \\dfrac12, 2/4) are accepted; the comparison is
sympy-based through math-verify (strict mode). Parsing and comparison are each bounded by
`timeout_s` through math-verify's SIGALRM timer, so `verify` must run on a process's main thread
(a ProcessPoolExecutor worker is fine; a thread pool is not).
"""

from __future__ import annotations

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers.base import (
    Outcome,
    VerifierResult,
    correct,
    extract_final_response,
    failed,
    strip_reasoning,
)
from megatron_apriel.verifiers.config import MathVerifierConfig

_BOXED = ("\\boxed{", "\\fbox{")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent or unclosed."""
    start = max(text.rfind(tag) for tag in _BOXED)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


class MathVerifier:
    domain = "math"

    def __init__(self, config: MathVerifierConfig = MathVerifierConfig()) -> None:
        self.config = config
        self._extraction = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

    def _parse(self, latex: str) -> list:
        return parse(latex, extraction_config=self._extraction, parsing_timeout=self.config.timeout_s,
                     raise_on_error=True)

    def verify(self, problem: Problem, completion: str) -> VerifierResult:
        if not isinstance(problem.reference, str) or not problem.reference.strip():
            raise ValueError(f"math problem {problem.id}: reference must be a non-empty answer string.")
        answer = last_boxed(extract_final_response(strip_reasoning(completion)))
        if answer is None:
            return failed(Outcome.NO_ANSWER, "no \\boxed{} answer")
        if not answer.strip() or len(answer) > self.config.max_answer_chars:
            return failed(Outcome.UNPARSABLE, f"empty or over-long boxed answer ({len(answer)} chars)")
        try:
            gold = self._parse(f"${problem.reference}$")
            if not gold:
                raise ValueError(f"math problem {problem.id}: cannot parse reference {problem.reference!r}")
            pred = self._parse(f"\\boxed{{{answer}}}")
            if not pred:
                return failed(Outcome.UNPARSABLE, f"cannot parse {answer[:200]!r}")
            ok = verify(gold, pred, timeout_seconds=self.config.timeout_s, strict=True, raise_on_error=True)
        except TimeoutException:
            return failed(Outcome.TIMEOUT, f"math-verify timed out on {answer[:200]!r}")
        if ok:
            return correct(answer[:200])
        return failed(Outcome.WRONG, f"{answer[:200]!r} != {problem.reference[:200]!r}")
