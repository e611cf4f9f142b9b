"""Environments for tests and benchmarks of the actor: instant ones (no verifier cost), and one
whose tool hangs (the actor must answer it with a time-out error and keep going). The factories
are module-level, so ``EpisodeWorkers`` can build them in its spawn processes."""

from __future__ import annotations

import itertools
import time

from megatron_apriel.envs.arithmetic import TOOLS, ArithmeticEnvironment
from megatron_apriel.envs.base import Reply, Start
from megatron_apriel.envs.calls import parse_calls
from megatron_apriel.envs.config import ArithmeticConfig, ToolCallConfig
from megatron_apriel.envs.tools import Toolbox
from megatron_apriel.records.rollouts import Outcome, Problem
from megatron_apriel.verifiers.base import VerifierResult, correct, failed


class InstantEnvironment:
    """Single-turn, every other episode correct: the actor's own cost, without a verifier's."""

    name = "instant"

    def __init__(self):
        self._count = itertools.count()

    def start(self, problem: Problem) -> "_Instant":
        return _Instant(problem, next(self._count) % 2 == 1)


class _Instant:
    def __init__(self, problem: Problem, right: bool):
        self.first = Start(messages=tuple(problem.prompt))
        self.right = right

    def step(self, text: str) -> Reply:
        return Reply.end()

    def score(self) -> VerifierResult:
        return correct() if self.right else failed(Outcome.WRONG)


class Sleeper:
    """A tool that hangs (``sleep``) and one that answers (``echo``)."""

    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "woke up"

    def echo(self, text: str) -> str:
        return text


class HangingEnvironment:
    """Each model turn with calls goes to ``Sleeper``; the first turn without a call ends the
    episode, correct if any tool answered with an error (the time-out), so a test can see it."""

    name = "hang"

    def __init__(self, calls: ToolCallConfig):
        self.calls = calls

    def start(self, problem: Problem) -> "_Hanging":
        return _Hanging(problem, self.calls)


class _Hanging:
    def __init__(self, problem: Problem, calls: ToolCallConfig):
        self.first = Start(messages=tuple(problem.prompt), tools=TOOLS)
        self.toolbox = Toolbox({"sleeper": Sleeper()}, calls)
        self.answers: list[str] = []

    def step(self, text: str) -> Reply:
        calls = parse_calls(text)
        if calls is None or len(self.answers) >= 4:
            return Reply.end()
        results = self.toolbox.answer_all(calls)
        self.answers += results
        return Reply.tool_results(results)

    def score(self) -> VerifierResult:
        errors = [a for a in self.answers if "timed out" in a]
        return correct(errors[0]) if errors else failed(Outcome.WRONG, "; ".join(self.answers)[:200])


def hanging_environments(timeout_s: float = 0.5):
    """The factory of a test's ``EpisodeWorkers``: ``hang`` (calls limited to ``timeout_s``) and
    ``arithmetic``, in forked children as in a run."""
    calls = ToolCallConfig(timeout_s=timeout_s, memory_mb=256)
    return {"hang": HangingEnvironment(calls), "arithmetic": ArithmeticEnvironment(ArithmeticConfig(), calls)}
