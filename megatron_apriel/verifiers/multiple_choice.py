"""Multiple-choice verifier (GPQA-Diamond, MMLU-Pro): the chosen letter of the final response.

Reference (JSON)::

    {"answer": "C", "choices": ["first option", "second option", "third option", "fourth option"]}

``choices`` are the options in the order the prompt shows them (letters A, B, C, ... in that
order); ``answer`` is the letter of the correct one. The model's letter is read from the final
response (`extract_final_response`, reasoning blocks removed) by `extract_choice`, in this order:

1. the last ``\\boxed{...}``: a lone letter, possibly wrapped (``\\boxed{\\text{(C)}}``, ``\\boxed{C.}``),
   or a letter opening an option (``\\boxed{C) 42}``);
2. the last "answer is C" / "Answer: (C)" / "final answer: **C**" phrase;
3. a final response that is nothing but a letter (``C``, ``(C)``, ``**C.**``).

A letter beyond the number of choices counts as a wrong answer (the model picked no option that
exists); text where none of the three forms appears is NO_ANSWER; a ``\\boxed{}`` whose content is
not a letter (``\\boxed{42}``) is UNPARSABLE.

This verifier is for evaluation only: it is not in `VERIFIERS` (the registry holds the five
training domains of the recipe, whose keys are part of the public contract and of the domain mix);
`megatron_apriel.eval.scoring.SCORERS` adds it for ``domain == "multiple_choice"``.
"""

from __future__ import annotations

import re
import string

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

LETTERS = string.ascii_uppercase
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
_LONE = re.compile(r"^[\s(\[*_]*([A-Z])[\s)\].:*_]*$")
_OPENING = re.compile(r"^[\s(\[*_]*([A-Z])(?:[).:]|\s*[-:])\s")
_PHRASE = re.compile(r"answer\s*(?:is|:)?\s*(?:option\s*)?[\s:(\[*_]*([A-Z])(?![A-Za-z0-9])", re.IGNORECASE)


def _unwrap(text: str) -> str:
    previous = None
    while previous != text:
        previous, text = text, _WRAPPERS.sub(r"\1", text)
    return text.strip().strip("$").strip()


def extract_choice(completion: str) -> tuple[str | None, str]:
    """``(letter, how)``: the upper-case letter the completion chose, or None, and which rule found
    it (``boxed``, ``phrase``, ``lone``) or why none did (``no_answer``, ``boxed_not_a_letter``)."""
    final = extract_final_response(strip_reasoning(completion))
    boxed = last_boxed(final)
    if boxed is not None:
        inner = _unwrap(boxed)
        match = _LONE.match(inner) or _OPENING.match(inner + " ")
        return (match.group(1), "boxed") if match else (None, "boxed_not_a_letter")
    phrases = list(_PHRASE.finditer(final))
    if phrases:
        letter = phrases[-1].group(1)
        if letter.isupper():  # "the answer is a ..." is prose, not option a
            return letter, "phrase"
    match = _LONE.match(_unwrap(final))
    if match:
        return match.group(1), "lone"
    return None, "no_answer"


class MultipleChoiceVerifier:
    domain = "multiple_choice"

    def verify(self, problem: Problem, completion: str) -> VerifierResult:
        ref = problem.reference
        if not isinstance(ref, dict) or not isinstance(ref.get("choices"), list) or len(ref["choices"]) < 2:
            raise ValueError(f"multiple-choice problem {problem.id}: reference needs 'choices', "
                             "a list of >= 2 options.")
        valid = LETTERS[: len(ref["choices"])]
        if ref.get("answer") not in tuple(valid):
            raise ValueError(f"multiple-choice problem {problem.id}: reference 'answer' must be one of {list(valid)}, "
                             f"got {ref.get('answer')!r}.")
        letter, how = extract_choice(completion)
        if letter is None:
            outcome = Outcome.UNPARSABLE if how == "boxed_not_a_letter" else Outcome.NO_ANSWER
            return failed(outcome, how)
        if letter not in valid:
            return failed(Outcome.WRONG, f"chose {letter} ({how}), but the options are {valid[0]}-{valid[-1]}")
        if letter == ref["answer"]:
            return correct(f"{letter} ({how})")
        return failed(Outcome.WRONG, f"chose {letter} ({how}), answer {ref['answer']}")
