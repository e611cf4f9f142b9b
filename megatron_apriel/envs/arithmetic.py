"""A small tool environment of our own, the example of ``docs/environments.md``: the model may
call a calculator, then answers with a number.

Problem (domain ``math``)::

    Problem(id="arith-1", domain="math", prompt=[{"role": "user", "content": "What is (12 + 30) * 3?"}],
            reference={"answer": 126}, metadata={"environment": "arithmetic"})

Each model turn with calls (``envs/calls.py``: ``[add(a=12, b=30)]`` or a ``<tool_calls>`` block) is
answered with the results; the first turn without a call is the answer, scored correct when the
last number in its final response (``\\boxed{}`` if present) equals ``reference["answer"]``
within 1e-6. More than ``max_steps`` turns with calls end the episode as a failure.
"""

from __future__ import annotations

import re

from megatron_apriel.envs.base import Reply, Start
from megatron_apriel.envs.calls import parse_calls
from megatron_apriel.envs.config import ArithmeticConfig, ToolCallConfig
from megatron_apriel.envs.tools import Toolbox
from megatron_apriel.records.rollouts import Outcome, Problem
from megatron_apriel.verifiers.base import VerifierResult, correct, extract_final_response, failed, strip_reasoning

SYSTEM = ("You can use a calculator. To call it, answer with a Python list of calls only, such as "
          "[add(a=1, b=2), multiply(a=3, b=4)]; you will get one result per call. When you know the answer, "
          "reply with it in \\boxed{}, without calls.")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class Calculator:
    """The tools: each public method is one function the model may call."""

    def add(self, a: float, b: float) -> float:
        return a + b

    def subtract(self, a: float, b: float) -> float:
        return a - b

    def multiply(self, a: float, b: float) -> float:
        return a * b

    def divide(self, a: float, b: float) -> float:
        return a / b


def _schema(name: str, what: str) -> dict:
    number = {"type": "number"}
    return {"type": "function", "function": {"name": name, "description": what, "parameters": {
        "type": "object", "properties": {"a": number, "b": number}, "required": ["a", "b"]}}}


TOOLS = (_schema("add", "a + b"), _schema("subtract", "a - b"), _schema("multiply", "a * b"),
         _schema("divide", "a / b"))
"""The calculator's schemas, for the chat template's ``tools=``."""


class ArithmeticEnvironment:
    name = "arithmetic"

    def __init__(self, config: ArithmeticConfig | None = None, calls: ToolCallConfig | None = None):
        self.config = config or ArithmeticConfig()
        self.calls = calls or ToolCallConfig()

    def start(self, problem: Problem) -> "ArithmeticEpisode":
        return ArithmeticEpisode(problem, self.config, self.calls)


class ArithmeticEpisode:
    def __init__(self, problem: Problem, config: ArithmeticConfig, calls: ToolCallConfig):
        self.problem = problem
        self.max_steps = config.max_steps
        self.first = Start(messages=({"role": "system", "content": SYSTEM}, *problem.prompt), tools=TOOLS)
        self.toolbox = Toolbox({"calculator": Calculator()}, calls)
        self.steps = 0
        self.answer: str | None = None
        self.done = False

    def step(self, text: str) -> Reply:
        if self.done:
            raise RuntimeError(f"{self.problem.id}: step after the end of the episode")
        calls = parse_calls(text)
        if calls is not None and self.steps < self.max_steps:
            self.steps += 1
            return Reply.tool_results(self.toolbox.answer_all(calls))
        self.done = True
        if calls is None:
            self.answer = extract_final_response(strip_reasoning(text))
        return Reply.end()

    def score(self) -> VerifierResult:
        if self.answer is None:
            return failed(Outcome.NO_ANSWER, "no answer without calls (step limit, or stopped)")
        boxed = _BOXED.findall(self.answer)
        numbers = _NUMBER.findall(boxed[-1] if boxed else self.answer)
        if not numbers:
            return failed(Outcome.NO_ANSWER, "no number in the answer")
        if abs(float(numbers[-1]) - float(self.problem.reference["answer"])) <= 1e-6:
            return correct(f"{numbers[-1]} after {self.steps} tool turns")
        return failed(Outcome.WRONG, f"{numbers[-1]} != {self.problem.reference['answer']}")
