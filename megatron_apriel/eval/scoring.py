"""Scorers of evaluation: the training verifiers, plus the eval-only multiple-choice verifier.

`SCORERS` extends `megatron_apriel.verifiers.VERIFIERS` (the five training domains, unchanged:
AIME is scored by the math verifier, LiveCodeBench by the code verifier and its sandbox) with
``multiple_choice`` (GPQA-Diamond, MMLU-Pro), which no training domain uses. `score_texts` runs
in a verifier process pool (`make_verifier_pool`), like the actor's verification.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers import VERIFIERS, Verifier, VerifierResult, run_verifier
from megatron_apriel.verifiers.multiple_choice import MultipleChoiceVerifier

SCORERS: Mapping[str, Verifier] = MappingProxyType({**VERIFIERS, "multiple_choice": MultipleChoiceVerifier()})


def score_texts(problem: Problem, texts: list[str]) -> list[VerifierResult]:
    """One result per text; a verifier crash becomes VERIFIER_ERROR (`run_verifier`)."""
    if problem.domain not in SCORERS:
        raise ValueError(f"problem {problem.id}: no scorer for domain {problem.domain!r}; known: {sorted(SCORERS)}.")
    return [run_verifier(SCORERS[problem.domain], problem, t) for t in texts]
