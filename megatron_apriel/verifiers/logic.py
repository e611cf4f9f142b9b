"""Logic verifier: procedurally generated puzzles (reasoning-gym) and INTELLECT-3-RL `logic` rows.

Reference, one of::

    {"source": "reasoning_gym", "task": "mini_sudoku", "entry": {"question", "answer", "metadata"}}
    {"source": "i3_logic", "task": "zebra_puzzle", "answer": "3", "game_data": {...}}

The model's answer is the last `\\boxed{}` of the final response, or the whole final response when
there is none. reasoning-gym entries are scored by the task's own exact scorer
(`reasoning_gym.get_score_answer_fn`; reward 1 iff it scores 1, else 0). INTELLECT-3-RL rows are
compared with the row's `answer` after normalisation (case, whitespace, surrounding punctuation),
or as Python/JSON literals when both sides parse: a faithful but generic stand-in for the 29
task-specific i3-logic verifiers, which this project does not vendor.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers.base import (
    Outcome,
    VerifierResult,
    correct,
    extract_final_response,
    failed,
    strip_reasoning,
)
from megatron_apriel.verifiers.math import last_boxed

REASONING_GYM_TASKS: tuple[str, ...] = (
    "mini_sudoku", "zebra_puzzles", "knights_knaves", "syllogism", "word_sorting", "letter_counting",
    "basic_arithmetic", "number_sorting", "spell_backward", "family_relationships",
)
"""Puzzle generators used for our procedural logic data (each has an exact scorer)."""

I3_SKIPPED_TASKS: tuple[str, ...] = ("arc_agi", "arc_agi_2", "buggy_tables", "dyck_language",
                                     "dyck_language_errors", "dyck_language_reasoning_errors")
"""INTELLECT-3-RL logic tasks the recipe leaves out (RECIPE.md section 6)."""


def extract_logic_answer(completion: str) -> str:
    final = extract_final_response(strip_reasoning(completion))
    boxed = last_boxed(final)
    return (boxed if boxed is not None else final).strip()


def _normalise(text: str) -> str:
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    return re.sub(r"\s+", " ", text).strip().strip(".,;:!\"'`").lower()


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None  # not a literal: compare as text


def i3_answer_matches(answer: str, gold: str) -> bool:
    if _normalise(answer) == _normalise(gold):
        return True
    a, g = _literal(answer.strip()), _literal(gold.strip())
    return a is not None and a == g


class LogicVerifier:
    domain = "logic"

    def verify(self, problem: Problem, completion: str) -> VerifierResult:
        ref = problem.reference
        source = ref.get("source") if isinstance(ref, dict) else None
        if source not in ("reasoning_gym", "i3_logic"):
            raise ValueError(f"logic problem {problem.id}: reference 'source' must be 'reasoning_gym' "
                             f"or 'i3_logic', got {source!r}.")
        answer = extract_logic_answer(completion)
        if not answer:
            return failed(Outcome.NO_ANSWER, "empty final response")
        if source == "reasoning_gym":
            import reasoning_gym  # ~2 s (with matplotlib): only where a logic problem is scored

            score = float(reasoning_gym.get_score_answer_fn(ref["task"])(answer, ref["entry"]))
            assert 0.0 <= score <= 1.0, f"reasoning-gym {ref['task']} returned score {score}"
            if score == 1.0:
                return correct(answer[:200])
            # reasoning-gym gives small "format" credit to some wrong answers; we keep rewards exact.
            return failed(Outcome.WRONG, f"{ref['task']}: {answer[:200]!r} scored {score}")
        if i3_answer_matches(answer, str(ref["answer"])):
            return correct(answer[:200])
        return failed(Outcome.WRONG, f"{ref['task']}: {answer[:200]!r} != {str(ref['answer'])[:200]!r}")
