"""The multiple-choice verifier's letter extraction (GPQA-Diamond, MMLU-Pro)."""

import pytest

from megatron_apriel.verifiers import Outcome
from megatron_apriel.verifiers.multiple_choice import MultipleChoiceVerifier, extract_choice
from tests.unit.conftest import apriel, make_problem

PROBLEM = make_problem("multiple_choice", {"answer": "C", "choices": ["1", "2", "3", "4"]})


@pytest.mark.parametrize("final, letter", [
    (r"\boxed{C}", "C"),
    (r"The answer is \boxed{\text{(C)}}.", "C"),
    (r"\boxed{C.}", "C"),
    (r"\boxed{C) 3}", "C"),
    (r"\boxed{$\mathbf{C}$}", "C"),
    (r"first \boxed{A}, on reflection \boxed{C}", "C"),
    ("So the answer is (C).", "C"),
    ("Answer: C", "C"),
    ("final answer: **C**", "C"),
    ("The answer is B, no wait, the answer is C", "C"),
    ("C", "C"),
    ("(C)", "C"),
    ("**C.**", "C"),
])
def test_letter_found(final, letter):
    assert extract_choice(apriel(final))[0] == letter
    assert MultipleChoiceVerifier().verify(PROBLEM, apriel(final)).success


def test_reasoning_is_ignored():
    text = apriel("A", reasoning=r"Maybe \boxed{C}? The answer is C... no.")
    assert extract_choice(text) == ("A", "lone")
    assert MultipleChoiceVerifier().verify(PROBLEM, text).outcome == Outcome.WRONG


@pytest.mark.parametrize("final, outcome", [
    ("I am not sure.", Outcome.NO_ANSWER),
    ("the answer is a number near three", Outcome.NO_ANSWER),  # prose, not option a
    (r"\boxed{3}", Outcome.UNPARSABLE),
    (r"\boxed{E}", Outcome.WRONG),  # no option E among four
    (r"\boxed{B}", Outcome.WRONG),
])
def test_failures_are_told_apart(final, outcome):
    result = MultipleChoiceVerifier().verify(PROBLEM, apriel(final))
    assert not result.success and result.outcome == outcome and result.score == 0.0


def test_a_bad_reference_is_a_verifier_error_not_a_model_failure():
    bad = make_problem("multiple_choice", {"answer": "Z", "choices": ["1", "2"]})
    with pytest.raises(ValueError, match="must be one of"):
        MultipleChoiceVerifier().verify(bad, apriel(r"\boxed{A}"))
