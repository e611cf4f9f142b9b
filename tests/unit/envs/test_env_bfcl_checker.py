"""BFCL v4 multi-turn as an environment, held to BFCL's official multi-turn checker.

Needs `pip install --no-deps bfcl-eval==2026.3.23`; skipped without it, except under CI. The full
table (every row, both mutations): `python -m tests.unit.envs.bfcl_official`.
"""

import random

import pytest

from megatron_apriel.envs.bfcl_multi_turn import CATEGORIES, BfclMultiTurnEnvironment, bfcl_data_dir, load_problems
from megatron_apriel.envs.config import BfclMultiTurnConfig, ToolCallConfig
from tests.ci import skip_or_fail

if bfcl_data_dir() is None:
    skip_or_fail("bfcl-eval is not installed: pip install --no-deps bfcl-eval==2026.3.23")

from tests.unit.envs import bfcl_official as official  # noqa: E402  (needs bfcl-eval)

INLINE = BfclMultiTurnEnvironment(calls=ToolCallConfig(isolate=False))
"""Calls run in this process: the same dispatch, without a fork per call (trusted sequences only)."""


@pytest.fixture(scope="module")
def problems():
    return [p for category in CATEGORIES for p in load_problems(category)]


def test_every_ground_truth_passes_ours_as_it_passes_the_official_checker(problems):
    assert len(problems) == 800 and {p.metadata["category"] for p in problems} == set(CATEGORIES)
    ours = [p.id for p in problems if official.our_valid(INLINE, p, official.ground_truth(p))]
    theirs = [p.id for p in problems if official.official_valid(p, official.ground_truth(p))]
    assert len(ours) == len(theirs) == 800


def test_mutated_ground_truths_get_the_official_verdict(problems):
    """One call dropped, or one argument changed, on every fourth row (the table covers all)."""
    verdicts = []
    for k, problem in enumerate(problems[::4]):
        rng = random.Random(k)
        for steps in (official.dropped_call(problem, rng), official.changed_argument(problem, rng)):
            if steps is not None:
                verdicts.append((problem.id, official.our_valid(INLINE, problem, steps),
                                 official.official_valid(problem, steps)))
    assert len(verdicts) >= 390
    assert [v for v in verdicts if v[1] != v[2]] == []
    # Both verdicts occur, so the comparison can tell a checker that always says no.
    assert 5 <= sum(v[2] for v in verdicts) <= len(verdicts) - 300


def test_calls_in_forked_children_give_the_same_verdicts(problems):
    """The default path (a fork per call, instances sent back) on one row of each category."""
    forked = BfclMultiTurnEnvironment()
    sample = [p for category in CATEGORIES for p in [q for q in problems if q.metadata["category"] == category][1:2]]
    rng = random.Random(0)
    for problem in sample:
        assert official.our_valid(forked, problem, official.ground_truth(problem))
        steps = official.dropped_call(problem, rng)
        assert official.our_valid(forked, problem, steps) == official.official_valid(problem, steps)


def test_miss_func_withholds_the_docs_until_their_turn(problems):
    problem = next(p for p in problems if p.id == "bfcl-multi_turn_miss_func_0")
    assert problem.reference["missed_function"] == {"3": ["sort"]}
    episode = INLINE.start(problem)
    system = episode.first.messages[0]["content"]
    assert episode.first.messages[0]["role"] == "system" and '"name": "grep"' in system
    assert '"name": "sort"' not in system and "[func_name1(params_name1=params_value1" in system
    replies = []
    for calls in problem.reference["ground_truth"]:
        if calls:
            episode.step("[" + ", ".join(calls) + "]")
        replies.append(episode.step("Done."))
    turn3 = replies[2].messages
    assert [m["role"] for m in turn3] == ["user"] and "'name': 'sort'" in turn3[0]["content"]
    assert turn3[0]["content"].endswith("I have updated some more functions you can choose from. What about now?")
    assert replies[-1].done and episode.score().success


def test_an_unfinished_or_runaway_episode_fails(problems):
    problem = next(p for p in problems if p.id == "bfcl-multi_turn_base_0")
    stopped = INLINE.start(problem)
    stopped.step("[" + ", ".join(problem.reference["ground_truth"][0]) + "]")
    assert not stopped.score().success and "force-terminated" in stopped.score().detail

    runaway = BfclMultiTurnEnvironment(BfclMultiTurnConfig(max_steps_per_turn=3), ToolCallConfig(isolate=False))
    episode = runaway.start(problem)
    assert [episode.step("[pwd()]").done for _ in range(4)] == [False, False, False, True]
    assert "more calls than allowed" in episode.score().detail


def test_a_model_turn_without_a_call_fails_a_turn_that_needs_one(problems):
    problem = next(p for p in problems if p.id == "bfcl-multi_turn_base_0")
    steps = official.ground_truth(problem)
    steps[1] = []
    assert official.our_valid(INLINE, problem, steps) is official.official_valid(problem, steps) is False
