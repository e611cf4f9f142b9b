"""What an in-flight update costs a trajectory, from its record: under ``recompute`` the reset
request's prefix (prompt, earlier turns, the turn's tokens before the update) is prefilled again;
a version that opens a turn costs nothing (the turn is a new request); under ``keep`` nothing is
recomputed and the tokens sampled over the older cache are counted instead."""

from megatron_apriel.records.rollouts import ModelTurn, VersionSpan
from megatron_apriel.trainer.update_cost import recomputed_tokens, stale_cache_tokens
from tests.unit.records.test_trajectories import PROMPT, multi_turn_rollout
from tests.unit.trainer.test_stale_cache import kept_rollout


def test_an_update_inside_a_turn_recomputes_that_request_up_to_the_update():
    # multi_turn_rollout: v3 starts at model token 4, the second token of turn 2 (completion 5-6);
    # that request was the prompt (3) + completion[:5] (turn 1 and the tool's 2 tokens) = 8 tokens,
    # plus token 13 it had sampled: 9 prefilled again. v5 opens turn 3, a new request: nothing.
    assert recomputed_tokens(len(PROMPT), multi_turn_rollout()) == 3 + 5 + 1


def test_a_single_turn_completion_recomputes_its_prompt_and_the_tokens_before_each_update():
    spans = [VersionSpan(version=1, start=0, end=2), VersionSpan(version=2, start=2, end=4),
             VersionSpan(version=3, start=4, end=5)]
    r = multi_turn_rollout(completion_ids=[7, 8, 9, 10, 11], logprobs=[-1.0] * 5, versions=spans,
                           model_turns=[ModelTurn(start=0, end=5)])
    assert recomputed_tokens(10, r) == (10 + 2) + (10 + 4)
    one_version = multi_turn_rollout(versions=[VersionSpan(version=2, start=0, end=6)])
    assert recomputed_tokens(10, one_version) == 0


def test_keep_recomputes_nothing_and_counts_the_tokens_over_a_stale_cache():
    r = kept_rollout()  # tokens 3 and 4 sampled by v3 over v2's cache
    assert recomputed_tokens(len(PROMPT), r) == 0
    assert stale_cache_tokens(r) == 2
    assert stale_cache_tokens(multi_turn_rollout()) == 0  # recompute: no context versions recorded
