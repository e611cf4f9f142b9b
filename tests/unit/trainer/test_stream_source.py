"""The trainer's stream source on one rank: which groups a step trains, the progress it publishes."""

import pytest

from megatron_apriel.parallel.rendezvous import single_process_world
from megatron_apriel.records.config import RolloutConfig
from megatron_apriel.records.rollouts import RolloutGroup
from megatron_apriel.records.stream import StreamWriter, read_progress
from megatron_apriel.trainer.stream_source import StreamSource
from tests.unit.records.test_stream import group, snap
from tests.unit.records.test_trajectories import COMPLETION, multi_turn_rollout


@pytest.fixture(scope="module")
def ctx():
    with single_process_world() as c:
        yield c


def write_groups(root, specs):
    """specs: (version, dropped) or (version, dropped, domain) per group, written one segment each."""
    writer = StreamWriter(root)
    for version, dropped, *domain in specs:
        update = {"dropped": dropped, "domain": domain[0] if domain else "math"}
        g = group(writer.next_seq, version=version).model_copy(update=update)
        writer.append([g], snap(writer.next_seq + 1))


def test_a_step_takes_usable_groups_in_order_and_skips_the_rest(tmp_path, ctx):
    write_groups(tmp_path, [(0, None), (0, "zero_advantage"), (0, None), (0, "verifier_error"), (0, None),
                            (2, None), (1, None)])
    source = StreamSource(tmp_path, RolloutConfig(group_size=2, groups_per_step=3, max_lag=1), ctx, {"math": 1.0})
    samples, m = source.next_batch(0)
    assert len(samples) == 6 and source.cursor == 5  # groups 0, 2, 4 trained; 1 and 3 dropped
    assert m["rollout/groups_filtered"] == 1 and m["rollout/groups_verifier_error"] == 1
    assert m["rollout/groups_read"] == 5 and m["rollout/cursor"] == 5 and m["rollout/lag_max"] == 0
    # metrics cover every group read (dropped included): group() gives rewards 1.0 and 0.0
    assert m["rollout/reward"] == pytest.approx(0.5) and m["mix/math/realised"] == m["mix/math/trained"] == 1.0
    assert read_progress(tmp_path).step == 1  # the step is full: the next group is step 1's
    source.weights_updated(3)
    assert read_progress(tmp_path).version == 3 and read_progress(tmp_path).cursor == 5


def test_groups_beyond_max_lag_are_skipped_and_counted(tmp_path, ctx):
    write_groups(tmp_path, [(0, None), (3, None), (4, None)])
    source = StreamSource(tmp_path, RolloutConfig(group_size=2, groups_per_step=2, max_lag=1), ctx, {"math": 1.0})
    _, m = source.next_batch(4)
    assert m["rollout/groups_stale"] == 1 and m["rollout/lag_mean"] == 0.5 and source.cursor == 3


def test_a_group_exactly_max_lag_old_is_trained_and_one_older_is_skipped_and_counted(tmp_path, ctx):
    write_groups(tmp_path, [(2, None), (3, None), (3, None)])  # at step 5: lags 3, 2, 2
    source = StreamSource(tmp_path, RolloutConfig(group_size=2, groups_per_step=2, max_lag=2), ctx, {"math": 1.0})
    samples, m = source.next_batch(5)
    assert m["rollout/groups_stale"] == 1 and source.cursor == 3 and len(samples) == 4
    assert m["rollout/lag_max"] == 2 and m["rollout/lag_mean"] == 2


def test_a_trajectory_is_as_old_as_its_oldest_model_token(tmp_path, ctx):
    """Its turns sampled by versions 2, 3 and 5: at step 5 its lag is 3, though its last turn is fresh;
    a group of version 3 throughout has lag 2 and is trained. The trained sample's lags are per model token."""
    writer = StreamWriter(tmp_path)
    spanning = group(0, version=5)
    trajectory = multi_turn_rollout(completion_ids=[0] + COMPLETION[1:])  # the prompt ends with seq 0
    spanning = spanning.model_copy(update={"rollouts": [trajectory, spanning.rollouts[1]]})
    writer.append([RolloutGroup.model_validate(spanning.model_dump())], snap(1))
    writer.append([group(1, version=3)], snap(2))
    source = StreamSource(tmp_path, RolloutConfig(group_size=2, groups_per_step=1, max_lag=2), ctx, {"math": 1.0})
    samples, m = source.next_batch(5)
    assert m["rollout/groups_stale"] == 1 and m["rollout/lag_max"] == 2 and source.cursor == 2
    source = StreamSource(tmp_path, RolloutConfig(group_size=2, groups_per_step=2, max_lag=3), ctx, {"math": 1.0})
    samples, m = source.next_batch(5)
    assert m["rollout/lag_max"] == 3 and samples[0].lags.tolist() == [3, 3, 3, 3, 2, 0]


def test_state_resumes_the_cursor(tmp_path, ctx):
    write_groups(tmp_path, [(0, None)] * 4)
    cfg = RolloutConfig(group_size=2, groups_per_step=1, max_lag=None)
    first = StreamSource(tmp_path, cfg, ctx, {"math": 1.0})
    first.next_batch(0)
    second = StreamSource(tmp_path, cfg, ctx, {"math": 1.0})
    second.load_state_dict(first.state_dict())
    samples, m = second.next_batch(1)
    assert m["rollout/cursor"] == 2 and samples[0].tokens[2] == 1  # group 1's prompt ends with its seq


def test_a_replay_reads_without_writing_and_says_when_the_stream_runs_out(tmp_path, ctx):
    write_groups(tmp_path, [(0, None)] * 3)
    cfg = RolloutConfig(source="replay", replay_from=str(tmp_path), group_size=2, groups_per_step=2, max_lag=None)
    source = StreamSource(tmp_path, cfg, ctx, {"math": 1.0}, replay=True)
    source.next_batch(0)
    source.weights_updated(1)
    assert read_progress(tmp_path) is None  # another run's stream: left as it was
    with pytest.raises(ValueError, match="ran out at step 1 .1 of 2 groups"):
        source.next_batch(1)  # one group left: an error, not a wait forever


MIXED = [(0, None, "math"), (0, "zero_advantage", "code"), (0, "zero_advantage", "code"), (0, None, "code"),
         (0, "verifier_error", "math"), (0, None, "math"), (0, None, "code"), (0, "zero_advantage", "math"),
         (0, None, "math"), (0, None, "code")]


def test_the_mix_of_groups_read_and_of_groups_trained_are_reported_over_the_run(tmp_path, ctx):
    """Step 0 reads groups 0-5 and trains 0, 3, 5; step 1 reads 6-9 and trains 6, 8, 9."""
    write_groups(tmp_path, MIXED)
    source = StreamSource(tmp_path, RolloutConfig(group_size=2, groups_per_step=3, max_lag=None), ctx,
                          {"math": 0.6, "code": 0.4})
    _, m = source.next_batch(0)
    assert (m["mix/math/realised"], m["mix/code/realised"]) == (3 / 6, 3 / 6)  # dropped groups included
    assert (m["mix/math/trained"], m["mix/code/trained"]) == (2 / 3, 1 / 3)
    assert (m["mix/math/target"], m["mix/code/target"]) == (0.6, 0.4)
    state = source.state_dict()
    _, m = source.next_batch(1)
    assert (m["mix/math/realised"], m["mix/code/trained"]) == (5 / 10, 3 / 6)  # cumulative, over both steps
    # resumed from the state after step 0, it reports the same; a state of an earlier release (no
    # "read") has the groups read recounted from the stream
    for saved in (state, {k: v for k, v in state.items() if k != "read"}):
        resumed = StreamSource(tmp_path, RolloutConfig(group_size=2, groups_per_step=3, max_lag=None), ctx,
                               {"math": 0.6, "code": 0.4})
        resumed.load_state_dict(saved)
        assert resumed.read == {"math": 3, "code": 3}
        assert mix_of(resumed.next_batch(1)[1]) == mix_of(m)


def mix_of(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("mix/")}
