"""The self-check environment: the user asks for a check after each answer but the last; the last
answer is what the domain's verifier scores."""

import pytest

from megatron_apriel.envs.config import EnvsConfig, SelfCheckConfig
from megatron_apriel.envs.registry import build_environments
from megatron_apriel.records.rollouts import Outcome
from tests.unit.conftest import apriel, make_problem

PROBLEM = make_problem("math", "7", "What is 3 + 4?")


def test_the_last_answer_is_scored_after_each_follow_up():
    env = build_environments(EnvsConfig(self_check=SelfCheckConfig(follow_ups=2, message="Sure?")))["self_check"]
    episode = env.start(PROBLEM)
    assert episode.first.messages == tuple(PROBLEM.prompt)
    assert episode.step(apriel(r"\boxed{7}")).messages == ({"role": "user", "content": "Sure?"},)
    assert episode.step(apriel(r"\boxed{7}")).messages == ({"role": "user", "content": "Sure?"},)
    assert episode.step(apriel(r"\boxed{8}")).done
    assert episode.score().outcome is Outcome.WRONG  # right twice, then changed its mind: the last counts
    with pytest.raises(RuntimeError, match="has ended"):
        episode.step("again")
    fixed = env.start(PROBLEM)
    for text in (r"\boxed{8}", r"\boxed{9}", r"\boxed{7}"):
        fixed.step(apriel(text))
    assert fixed.score().success


def test_a_cut_episode_scores_its_last_answer_and_bad_settings_say_so():
    env = build_environments()["self_check"]
    episode = env.start(PROBLEM)
    assert episode.score().outcome is Outcome.NO_ANSWER
    episode.step(apriel(r"\boxed{7}"))  # the loop stopped it here (its token budget)
    assert episode.score().success
    with pytest.raises(ValueError, match="follow_ups >= 1"):
        SelfCheckConfig(follow_ups=0)
    with pytest.raises(ValueError, match="domain verifier"):
        build_environments(verifiers={})["self_check"].start(PROBLEM)
