"""Self-check: after the model's answer the user asks it to check the answer and give it again,
``follow_ups`` times; the last answer is scored by the problem's domain verifier. A multi-turn
episode without tools (the model's turns and the user's, alternating), for any domain: the
model is rewarded for its final answer, as in self-correction training, and the loop's multi-turn
path (token in, token out, the environment's template tokens between turns, masks) runs with a
model that calls no tools (the tiny base does not).

    actor.environments={math: self_check}    # every math problem, two model turns
"""

from __future__ import annotations

from typing import Mapping

from megatron_apriel.envs.base import Reply, Start
from megatron_apriel.envs.config import SelfCheckConfig
from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers.base import Outcome, Verifier, VerifierResult, failed, run_verifier


class SelfCheckEnvironment:
    name = "self_check"

    def __init__(self, settings: SelfCheckConfig, verifiers: Mapping[str, Verifier]):
        self.settings, self.verifiers = settings, verifiers

    def start(self, problem: Problem) -> "SelfCheckEpisode":
        if problem.domain not in self.verifiers:
            raise ValueError(f"self_check scores with the problem's domain verifier; {problem.id} is of domain "
                             f"{problem.domain!r}, which has none ({sorted(self.verifiers)}).")
        return SelfCheckEpisode(problem, self.verifiers[problem.domain], self.settings)


class SelfCheckEpisode:
    def __init__(self, problem: Problem, verifier: Verifier, settings: SelfCheckConfig):
        self.problem, self.verifier, self.settings = problem, verifier, settings
        self.first = Start(messages=tuple(problem.prompt), tools=tuple(problem.metadata.get("tools") or ()))
        self.answers: list[str] = []

    def step(self, text: str) -> Reply:
        if len(self.answers) > self.settings.follow_ups:
            raise RuntimeError(f"{self.problem.id}: the self-check episode has ended.")
        self.answers.append(text)
        if len(self.answers) > self.settings.follow_ups:
            return Reply.end()
        return Reply(messages=({"role": "user", "content": self.settings.message},))

    def score(self) -> VerifierResult:
        """The last answer, by the domain's verifier (an episode the loop cut short: its last answer)."""
        if not self.answers:
            return failed(Outcome.NO_ANSWER, "the episode ended before the model's turn")
        return run_verifier(self.verifier, self.problem, self.answers[-1])
