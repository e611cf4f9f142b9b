import time

import pytest
import reasoning_gym

from megatron_apriel.verifiers import VERIFIERS, Outcome, extract_final_response, run_verifier, verify
from megatron_apriel.verifiers.config import MathVerifierConfig
from megatron_apriel.verifiers.math import MathVerifier, last_boxed
from tests.unit.conftest import apriel, make_problem


def test_extract_final_response():
    assert extract_final_response("think [BEGIN FINAL RESPONSE] 42 [END FINAL RESPONSE]<|end|>") == "42"
    assert extract_final_response("think [BEGIN FINAL RESPONSE] 42") == "42"  # stop string ate the end marker
    assert extract_final_response("  no markers ") == "no markers"


def test_last_boxed_nested():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None
    assert last_boxed("none") is None


@pytest.mark.parametrize("gold", [r"\frac{1}{2}", "0.5", "1/2"])
@pytest.mark.parametrize("pred", [r"\frac{1}{2}", "0.5", "1/2", r"\dfrac12", r"\frac{2}{4}", r"\tfrac{1}{2}"])
def test_math_equivalent_forms(gold, pred):
    r = verify("math", make_problem("math", gold), apriel(rf"The answer is $\boxed{{{pred}}}$."))
    assert r.outcome is Outcome.CORRECT and r.score == 1.0 and r.success


@pytest.mark.parametrize("gold,pred", [(r"\sqrt{2}", r"2^{1/2}"), ("x^2+2x+1", "(x+1)^2"), (r"\{1,2\}", r"\{2,1\}"),
                                       ("(0,1]", "(0,1]"), ("12", "12.0")])
def test_math_symbolic_equivalence(gold, pred):
    assert verify("math", make_problem("math", gold), apriel(rf"\boxed{{{pred}}}")).success


def test_math_failures():
    p = make_problem("math", r"\frac{1}{2}")
    assert verify("math", p, apriel(r"\boxed{0.51}")).outcome is Outcome.WRONG
    assert verify("math", p, apriel(r"\boxed{[0, 1]}")).outcome is Outcome.WRONG
    assert verify("math", p, apriel("one half")).outcome is Outcome.NO_ANSWER
    assert verify("math", p, apriel(r"\boxed{}")).outcome is Outcome.UNPARSABLE
    # the boxed answer in the reasoning does not count when a final response exists
    assert verify("math", p, apriel("no box here", reasoning=r"maybe \boxed{1/2}")).outcome is Outcome.NO_ANSWER
    # the last box wins
    assert verify("math", p, apriel(r"\boxed{3} no wait \boxed{1/2}")).success


@pytest.mark.parametrize("answer", [r"\sqrt[9^{9^9}]{2}", r"9^{9^{9}}"], ids=["in_parsing", "in_comparison"])
def test_math_pathological_answer_times_out_within_its_budget(answer):
    """Numbers with some 370 million digits: math-verify's timers (timeout_s to parse, then timeout_s to
    compare) must stop them, and the result is TIMEOUT, a model failure. The first answer stalls the
    parser, the second the comparison."""
    timeout_s = 2
    verifier = MathVerifier(MathVerifierConfig(timeout_s=timeout_s))
    start = time.monotonic()
    r = run_verifier(verifier, make_problem("math", "1"), apriel(rf"\boxed{{{answer}}}"))
    elapsed = time.monotonic() - start
    assert r.outcome is Outcome.TIMEOUT and r.score == 0.0 and r.is_model_failure
    assert timeout_s <= elapsed < 2 * timeout_s + 1


def test_math_bad_reference_is_verifier_error():
    r = verify("math", make_problem("math", {"not": "a string"}), apriel(r"\boxed{1}"))
    assert r.outcome is Outcome.VERIFIER_ERROR and not r.is_model_failure
    assert "reference" in r.detail


@pytest.mark.parametrize("task", ["mini_sudoku", "knights_knaves", "word_sorting", "basic_arithmetic", "syllogism"])
def test_logic_reasoning_gym(task):
    entry = reasoning_gym.create_dataset(task, size=1, seed=3)[0]
    ref = {"source": "reasoning_gym", "task": task, "entry": entry}
    p = make_problem("logic", ref, entry["question"])
    assert verify("logic", p, apriel(rf"\boxed{{{entry['answer']}}}")).success
    assert verify("logic", p, apriel(entry["answer"])).success  # no box: the final response is the answer
    wrong = verify("logic", p, apriel(r"\boxed{I am not sure}"))
    assert wrong.outcome is Outcome.WRONG and wrong.score == 0.0


def test_logic_i3_format():
    ref = {"source": "i3_logic", "task": "zebra_puzzle", "answer": "[[1, 2], [3]]", "game_data": {}}
    p = make_problem("logic", ref)
    assert verify("logic", p, apriel(r"\boxed{[[1,2],[3]]}")).success
    assert verify("logic", p, apriel(r"\boxed{[[1,2],[4]]}")).outcome is Outcome.WRONG
    p = make_problem("logic", {"source": "i3_logic", "task": "web_of_lies", "answer": "Yes", "game_data": {}})
    assert verify("logic", p, apriel(r"\boxed{\text{yes}}")).success
    assert verify("logic", p, apriel("")).outcome is Outcome.NO_ANSWER
    bad = verify("logic", make_problem("logic", {"source": "elsewhere"}), "x")
    assert bad.outcome is Outcome.VERIFIER_ERROR


def test_registry_has_five_domains():
    assert set(VERIFIERS) == {"math", "code", "logic", "ifeval", "function_calling"}
    assert all(v.domain == k for k, v in VERIFIERS.items())
    with pytest.raises(ValueError):
        verify("chess", make_problem("math", "1"), "x")


def test_run_verifier_boundary_keeps_exception_text():
    class Broken:
        domain = "math"

        def verify(self, problem, completion):
            raise KeyError("boom")
    r = run_verifier(Broken(), make_problem("math", "1"), "x")
    assert r.outcome is Outcome.VERIFIER_ERROR and "boom" in r.detail and r.score == 0.0
