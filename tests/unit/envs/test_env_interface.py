"""The environment contract, and the single-turn verifiers as its one-step case."""

import pytest

from megatron_apriel.envs.base import Reply, Start, score_episode
from megatron_apriel.envs.registry import ENVIRONMENTS, build_environments
from megatron_apriel.envs.single_turn import SingleTurnEnvironment
from megatron_apriel.verifiers import VERIFIERS, Outcome, run_verifier
from tests.unit.conftest import apriel, make_problem

FC_TOOLS = [{"name": "get_weather", "parameters": {"type": "dict", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"]}}]
CASES = [
    (make_problem("math", "0.5"), [apriel(r"\boxed{\frac{1}{2}}"), apriel(r"\boxed{2}"), "no box at all"]),
    (make_problem("math", {"not": "a string"}), [apriel(r"\boxed{1}")]),  # a verifier crash
    (make_problem("logic", {"source": "i3_logic", "task": "web_of_lies", "answer": "Yes", "game_data": {}}),
     [apriel(r"\boxed{\text{yes}}"), apriel(r"\boxed{No}"), apriel("")]),
    (make_problem("ifeval", {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}),
     [apriel("no commas here"), apriel("a, b")]),
    (make_problem("function_calling", {"ground_truth": [{"get_weather": {"city": ["Paris"]}}], "functions": FC_TOOLS}),
     [apriel('<tool_calls>[{"name": "get_weather", "arguments": {"city": "paris"}}]</tool_calls>'),
      apriel('<tool_calls>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_calls>'),
      apriel("<tool_calls>[oops</tool_calls>")]),
]


@pytest.mark.parametrize("problem, completions", CASES, ids=[f"{c[0].domain}-{i}" for i, c in enumerate(CASES)])
def test_a_verifier_is_the_one_step_environment(problem, completions):
    env = ENVIRONMENTS[problem.domain]
    assert isinstance(env, SingleTurnEnvironment) and env.verifier is VERIFIERS[problem.domain]
    outcomes = set()
    for text in completions:
        episode = env.start(problem)
        assert episode.first.messages == tuple(problem.prompt)
        assert episode.step(text) == Reply.end()
        result = score_episode(episode)
        assert result == run_verifier(VERIFIERS[problem.domain], problem, text)
        outcomes.add(result.outcome)
        with pytest.raises(RuntimeError):
            episode.step(text)
    assert len(outcomes) == len(completions)  # the cases tell apart what the verifier tells apart


def test_every_verifier_has_its_environment_and_tools_reach_the_template():
    assert set(VERIFIERS) < set(ENVIRONMENTS) and {"bfcl_multi_turn", "arithmetic"} < set(ENVIRONMENTS)
    problem = make_problem("function_calling", {"ground_truth": [{"f": {}}]})
    problem.metadata["tools"] = FC_TOOLS
    assert ENVIRONMENTS["function_calling"].start(problem).first.tools == tuple(FC_TOOLS)
    unstepped = ENVIRONMENTS["math"].start(make_problem("math", "1"))
    assert score_episode(unstepped).outcome is Outcome.NO_ANSWER
    assert set(build_environments(verifiers={})) == {"bfcl_multi_turn", "arithmetic", "self_check"}


def test_the_messages_of_a_start_and_a_reply_are_checked():
    with pytest.raises(ValueError, match="at least one"):
        Start(messages=())
    with pytest.raises(ValueError, match="role"):
        Start(messages=({"role": "tool", "content": "x"},))
    with pytest.raises(ValueError, match="either ends"):
        Reply(messages=({"role": "user", "content": "x"},), done=True)
    with pytest.raises(ValueError, match="either ends"):
        Reply()
    with pytest.raises(ValueError, match="role"):
        Reply(messages=({"role": "assistant", "content": "x"},))
    tool = Reply.tool_results(["1", "2"])
    assert tool.messages == ({"role": "tool", "content": "1"}, {"role": "tool", "content": "2"})


def test_a_crash_of_the_environment_is_a_verifier_error_not_a_model_failure():
    class Broken:
        first = Start(messages=({"role": "user", "content": "hi"},))

        def step(self, text):
            return Reply.end()

        def score(self):
            raise KeyError("bug")

    result = score_episode(Broken())
    assert result.outcome is Outcome.VERIFIER_ERROR and not result.is_model_failure and "KeyError" in result.detail
