"""A single-turn verifier as the one-step environment: the episode ends after the model's first
turn, and its score is the verifier's result on that turn's text (through ``run_verifier``, so a
verifier crash is VERIFIER_ERROR here too). The start is the problem's prompt, with the tool
schemas a function-calling problem carries (``metadata["tools"]``, as ``data/prompts.py`` renders)."""

from __future__ import annotations

from megatron_apriel.envs.base import Reply, Start
from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers.base import Outcome, Verifier, VerifierResult, failed, run_verifier


class SingleTurnEnvironment:
    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self.name = verifier.domain

    def start(self, problem: Problem) -> "SingleTurnEpisode":
        return SingleTurnEpisode(problem, self.verifier)


class SingleTurnEpisode:
    def __init__(self, problem: Problem, verifier: Verifier):
        self.problem = problem
        self.verifier = verifier
        self.first = Start(messages=tuple(problem.prompt), tools=tuple(problem.metadata.get("tools") or ()))
        self.completion: str | None = None

    def step(self, text: str) -> Reply:
        if self.completion is not None:
            raise RuntimeError(f"{self.problem.id}: a single-turn episode takes one model turn.")
        self.completion = text
        return Reply.end()

    def score(self) -> VerifierResult:
        if self.completion is None:
            return failed(Outcome.NO_ANSWER, "the episode ended before the model's turn")
        return run_verifier(self.verifier, self.problem, self.completion)
