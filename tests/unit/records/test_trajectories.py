"""Multi-turn trajectories in the rollout record (schema 4, written as 5 since): model turns and environment tokens in
one id array, the model's tokens' log-probs and versions, the mask the trainer gets; and records of
schemas 1 to 3 read as the one-turn case they are."""

import numpy as np
import pytest

from megatron_apriel.records.rollouts import ModelTurn, Rollout, RolloutGroup, RoutedExperts, VersionSpan
from megatron_apriel.records.stream import StreamReader, StreamWriter
from tests.unit.records.test_stream import group, snap

PROMPT = [1, 2, 3]
# model turn (sampled by v2) | tool turn | model turn (v2, then v3 from inside it) | user turn | model turn (v5)
COMPLETION = [10, 11, 12, 50, 51, 13, 14, 52, 53, 54, 15]
TURNS = [(0, 3), (5, 7), (10, 11)]
MASK = [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1]
LOGPROBS = [-0.5, -0.25, -1.0, -2.0, -0.125, -3.0]  # one per model token
SPANS = [(2, 0, 4), (3, 4, 5), (5, 5, 6)]  # (version, start, end) over the 6 model tokens


def multi_turn_rollout(**update) -> Rollout:
    fields = dict(completion_ids=COMPLETION, logprobs=LOGPROBS,
                  versions=[VersionSpan(version=v, start=a, end=b) for v, a, b in SPANS],
                  model_turns=[ModelTurn(start=a, end=b) for a, b in TURNS], finish_reason="stop", truncated=True,
                  outcome="wrong", score=0.0, success=False, reward=-0.1, advantage=-0.7, server="http://s:1")
    return Rollout(**{**fields, **update})


def multi_turn_group(routed: bool = False) -> RolloutGroup:
    g = group(0)
    r = multi_turn_rollout()
    if routed:  # vLLM's experts for the prompt and every completion token but the last, the tool's included
        ids = np.arange((len(PROMPT) + len(COMPLETION) - 1) * 2 * 2).reshape(-1, 2, 2) % 7
        r = r.model_copy(update={"routed_experts": RoutedExperts.from_array(ids.astype(np.uint8))})
    return RolloutGroup.model_validate({**g.model_dump(), "prompt_ids": PROMPT,
                                        "rollouts": [r.model_dump(), g.rollouts[0].model_dump()]})


def test_a_trajectory_round_trips_through_the_stream_by_its_wire_form(tmp_path):
    g = multi_turn_group(routed=True)
    assert RolloutGroup.model_validate_json(g.model_dump_json()) == g
    StreamWriter(tmp_path).append([g], snap(1))
    back = StreamReader(tmp_path).next_group()
    assert back.model_dump_json() == g.model_copy(update={"seq": 0}).model_dump_json()
    r = back.rollouts[0]
    assert back.schema_version == 5 and r.completion_ids.tolist() == COMPLETION
    assert r.mask.astype(int).tolist() == MASK and r.model_length == 6 and r.length == 11
    assert [(t.start, t.end) for t in r.model_turns] == TURNS and r.truncated and r.finish_reason == "stop"
    assert r.logprobs.tolist() == LOGPROBS and r.routed_experts.shape == (13, 2, 2)
    single = back.rollouts[1]  # a single-turn completion is the one-turn case of the same record
    assert [(t.start, t.end) for t in single.model_turns] == [(0, 5)] and single.mask.all()


def test_the_sample_scores_the_model_tokens_only_with_their_lags_and_routes():
    g = multi_turn_group(routed=True)
    s = g.train_sample(0, version=5, moe_layers=[1])
    assert s.tokens.tolist() == PROMPT + COMPLETION and s.prompt_len == 3
    assert s.mask.astype(int).tolist() == MASK and s.behaviour_logprobs.tolist() == LOGPROBS
    assert s.lags.tolist() == [3, 3, 3, 3, 2, 0] and s.fresh_start == 5 and s.truncated
    ids = g.rollouts[0].routed_experts.array()
    assert np.array_equal(s.routing[:13, 0], ids[:, 1]) and (s.routing[13] == -1).all()  # tool tokens replayed
    plain = g.train_sample(1, version=5)
    assert plain.mask is None and plain.model_length == 5


def test_the_lag_counts_the_oldest_model_token():
    g = multi_turn_group()
    assert g.rollouts[0].first_version == 2 and g.min_version == 0  # the single-turn rollout was version 0
    late_first = multi_turn_rollout(versions=[VersionSpan(version=5, start=0, end=3),
                                              VersionSpan(version=4, start=3, end=6)])
    assert late_first.first_version == 4  # the oldest, whichever turn holds it
    assert late_first.token_lags(6).tolist() == [1, 1, 1, 2, 2, 2]


def test_older_schemas_read_as_one_model_turn_over_the_completion():
    for schema, finish in ((3, "stop"), (2, "length"), (1, "stop")):
        old = group(0, version=1).model_dump(mode="json")
        old["schema_version"] = schema
        old["rollouts"][1]["finish_reason"] = finish
        for r in old["rollouts"]:
            del r["model_turns"], r["truncated"]
            if schema < 3:
                del r["routed_experts"]
            if schema < 2:
                del r["detail"]
        g = RolloutGroup.model_validate(old)
        assert [r.mask.tolist() for r in g.rollouts] == [[True] * 5] * 2
        assert [r.truncated for r in g.rollouts] == [False, finish == "length"]
        s = g.train_sample(1, version=1)
        assert s.mask is None and s.lags.tolist() == [0] * 5 and s.truncated == (finish == "length")
        assert s.behaviour_logprobs.tolist() == [-0.5] * 5


@pytest.mark.parametrize("turns, message", [
    ([(0, 3), (3, 7), (10, 11)], "at least one environment token between"),
    ([(0, 3), (5, 7), (6, 11)], "in order"),
    ([(0, 3), (5, 7), (9, 9), (10, 11)], "non-empty"),
    ([(0, 3), (5, 7)], "leave out environment tokens after the last model turn"),
    ([], "at least one model turn"),
])
def test_bad_turns_are_refused_saying_why(turns, message):
    with pytest.raises(ValueError, match=message):
        multi_turn_rollout(model_turns=[ModelTurn(start=a, end=b) for a, b in turns])


def test_log_probs_versions_and_truncation_must_fit_the_model_tokens():
    with pytest.raises(ValueError, match="6 model tokens but 11 log-probs"):
        multi_turn_rollout(logprobs=[-1.0] * 11)
    with pytest.raises(ValueError, match="do not cover the 6 model tokens"):
        multi_turn_rollout(versions=[VersionSpan(version=0, start=0, end=11)])
    with pytest.raises(ValueError, match="set truncated=true"):
        multi_turn_rollout(finish_reason="length", truncated=False)
    with pytest.raises(ValueError, match="prompt \\+ completion - 1"):
        RolloutGroup.model_validate({**multi_turn_group().model_dump(), "rollouts": [
            multi_turn_rollout(routed_experts=RoutedExperts.from_array(np.zeros((8, 1, 1), np.uint8))).model_dump()]})
