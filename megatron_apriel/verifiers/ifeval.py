"""IFEval verifier: verifiable instructions with partial credit, via the `if-verifiable` library.

Reference::

    {"instruction_id_list": ["punctuation:no_comma", "keywords:existence"],
     "kwargs": [{}, {"keywords": ["apple"]}]}

The final response is checked against each instruction in strict mode (IFEval's registry of 25
instruction types); score = followed / total, success iff all are followed (RECIPE.md section 6).
An instruction id outside the registry is a data error (raised), never silently skipped.
`length_constraints:number_sentences` needs NLTK's punkt data; without it that check raises.
"""

from __future__ import annotations

import functools
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


@functools.cache
def _instructions() -> dict:
    """if_verifiable's instruction registry, imported on first use: with langdetect and nltk it
    takes ~1.7 s, which an actor or verifier worker that never scores IFEval need not pay."""
    import langdetect
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    # Language checks go through langdetect, which samples at random unless its factory is seeded;
    # rewards must not depend on chance. (A process-wide setting of that library.)
    langdetect.DetectorFactory.seed = 0
    return INSTRUCTION_DICT


def supported_instructions() -> frozenset[str]:
    """The instruction ids the verifier knows."""
    return frozenset(_instructions())


def check_reference(reference: Any) -> None:
    """Raise ValueError unless `reference` is a well-formed IFEval reference with known instructions."""
    if not isinstance(reference, dict) or set(reference) != {"instruction_id_list", "kwargs"}:
        raise ValueError("ifeval reference must be {'instruction_id_list': [...], 'kwargs': [...]}.")
    ids, kwargs = reference["instruction_id_list"], reference["kwargs"]
    if not ids or len(ids) != len(kwargs):
        raise ValueError(f"ifeval reference: {len(ids)} instructions but {len(kwargs)} kwargs; give one "
                         "kwargs dict (possibly empty) per instruction.")
    unknown = sorted(set(ids) - supported_instructions())
    if unknown:
        raise ValueError(f"ifeval reference: unsupported instruction ids {unknown}; "
                         f"supported: {sorted(supported_instructions())}.")


def _prompt_text(problem: Problem) -> str:
    return "\n".join(m["content"] for m in problem.prompt if m["role"] == "user")


class IFEvalVerifier:
    domain = "ifeval"

    def verify(self, problem: Problem, completion: str) -> VerifierResult:
        check_reference(problem.reference)
        response = extract_final_response(strip_reasoning(completion))
        if not response:
            return failed(Outcome.NO_ANSWER, "empty final response")
        ids = problem.reference["instruction_id_list"]
        from if_verifiable.common import evaluate_instructions

        results, _ = evaluate_instructions(response=response, instruction_id_list=ids,
                                           kwargs_list=problem.reference["kwargs"],
                                           prompt=_prompt_text(problem), instruction_registry=_instructions())
        assert len(results) == len(ids), "every instruction id was validated against the registry"
        followed = sum(r.strict_pass for r in results)
        detail = ", ".join(f"{r.instruction_id}={'ok' if r.strict_pass else 'no'}" for r in results)
        if followed == len(ids):
            return correct(detail)
        return failed(Outcome.WRONG, detail, score=followed / len(ids))
