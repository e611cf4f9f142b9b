"""Admission control: simulated actor and trainer, every trained group within max_lag."""

import random

import pytest

from megatron_apriel.records.lag import may_admit, predicted_step
from megatron_apriel.records.stream import TrainerProgress


def progress(step=0, filled=0, cursor=0, version=0):
    return TrainerProgress(step=step, filled=filled, cursor=cursor, version=version)


def test_synchronous_mode_admits_one_step_only_after_the_push():
    # trainer has read step 3's groups (filling step 4 next) but not yet pushed version 4
    assert not may_admit(progress(step=4, version=3), queued=0, groups_per_step=2, max_lag=0, max_queued=100)
    after_push = progress(step=4, version=4)
    assert [may_admit(after_push, queued=q, groups_per_step=2, max_lag=0, max_queued=100)
            for q in range(3)] == [True, True, False]
    # one group of step 4 already read: one more may start
    assert [may_admit(progress(step=4, filled=1, version=4), queued=q, groups_per_step=2, max_lag=0, max_queued=100)
            for q in range(2)] == [True, False]


def test_queue_cap_holds_without_a_lag_bound():
    def admit(queued):
        return may_admit(progress(), queued=queued, groups_per_step=4, max_lag=None, max_queued=8)

    assert admit(7) and not admit(8)


def test_predicted_step_counts_what_is_ahead():
    assert predicted_step(progress(step=5, filled=3), position=0, groups_per_step=4) == 5
    assert predicted_step(progress(step=5, filled=3), position=1, groups_per_step=4) == 6


def simulate(max_lag, gps, steps, seed, drop_rate=0.3, train_ticks=3, gen_ticks=(1, 6), in_flight=12):
    """A discrete-time actor/trainer pair following the real protocol; returns the lag of every
    trained group. Groups finish out of order and some are dropped by the filters."""
    rng = random.Random(seed)
    stream, running, lags = [], [], []  # stream: (min_version, dropped); running: [finish_tick, version]
    prog = progress()
    step, filled, cursor, version, busy_until, tick = 0, 0, 0, 0, 0, 0
    while step < steps:
        tick += 1
        for r in [r for r in running if r[0] <= tick]:
            running.remove(r)
            stream.append((r[1], rng.random() < drop_rate))
        # ahead of a new group: written groups the trainer will train (the dropped ones it skips do
        # not count, as in the actor) and every group in flight
        queued = sum(not dropped for _, dropped in stream[prog.cursor:]) + len(running)
        oldest = min((r[1] for r in running), default=None)
        while len(running) < in_flight and may_admit(prog, queued=queued, groups_per_step=gps, max_lag=max_lag,
                                                                max_queued=10 * gps, oldest_in_flight=oldest):
            running.append([tick + rng.randint(*gen_ticks), prog.version])  # sampled at >= the published version
            queued += 1
            oldest = prog.version if oldest is None else oldest
        if tick < busy_until:
            continue
        if filled == gps:  # the step was trained: push, publish the new version
            step, filled, version = step + 1, 0, step + 1
        while filled < gps and cursor < len(stream):
            v, dropped = stream[cursor]
            cursor += 1
            if dropped:
                continue
            assert max_lag is None or step - v <= max_lag, "admission let a group grow too old"
            lags.append(step - v)
            filled += 1
        if filled == gps:
            busy_until = tick + train_ticks
            prog = progress(step=step + 1, filled=0, cursor=cursor, version=version)
        else:
            prog = progress(step=step, filled=filled, cursor=cursor, version=version)
    return lags


@pytest.mark.parametrize("drop_rate", [0.3, 0.8])
@pytest.mark.parametrize("max_lag", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_simulated_run_never_exceeds_the_bound_and_uses_it(max_lag, seed, drop_rate):
    lags = simulate(max_lag, gps=4, steps=60, seed=seed, drop_rate=drop_rate)
    assert len(lags) >= 4 * 59 and max(lags) <= max_lag
    if max_lag:
        assert max(lags) > 0  # not just safe: generation runs ahead of training (overlaps it)
