"""The example tool environment of docs/environments.md."""

from megatron_apriel.envs.arithmetic import TOOLS, ArithmeticEnvironment
from megatron_apriel.envs.config import ArithmeticConfig, ToolCallConfig
from megatron_apriel.records.rollouts import Outcome
from tests.unit.conftest import apriel, make_problem

PROBLEM = make_problem("math", {"answer": 126}, "What is (12 + 30) * 3?")


def test_calls_then_an_answer():
    episode = ArithmeticEnvironment().start(PROBLEM)  # the default: each call in a forked child
    assert episode.first.messages[0]["role"] == "system" and episode.first.tools == TOOLS
    assert episode.step(apriel("[add(a=12, b=30)]")).messages == ({"role": "tool", "content": "42"},)
    json_call = '<tool_calls>[{"name": "multiply", "arguments": {"a": 42, "b": 3}}]</tool_calls>'
    assert episode.step(apriel(json_call)).messages == ({"role": "tool", "content": "126"},)
    assert episode.step(apriel(r"It is \boxed{126}.")).done
    assert episode.score().success


def test_wrong_errors_and_limits():
    inline = ArithmeticEnvironment(ArithmeticConfig(max_steps=2), ToolCallConfig(isolate=False))
    episode = inline.start(PROBLEM)
    answers = episode.step("[divide(a=1, b=0), add(a=1), power(a=2, b=3)]").messages
    assert [m["content"] for m in answers] == [
        "Error during execution: division by zero",
        "Error during execution: Calculator.add() missing 1 required positional argument: 'b'",
        "Error during execution: name 'power' is not defined"]
    assert episode.step("[add(a=1, b=1)]").messages[0]["content"] == "2"
    assert episode.step("[add(a=1, b=1)]").done  # a third turn with calls: over the limit
    assert episode.score().outcome is Outcome.NO_ANSWER
    wrong = inline.start(PROBLEM)
    wrong.step(r"\boxed{125}")
    assert wrong.score().outcome is Outcome.WRONG
