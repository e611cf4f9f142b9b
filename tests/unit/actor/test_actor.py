"""The actor against a fake fleet (real FleetClient, verifiers, stream), with a simulated trainer
that follows the real protocol: read groups, publish progress, push a new version."""

import asyncio
from collections import Counter

import pytest

from megatron_apriel.actor.config import ActorConfig
from megatron_apriel.actor.episodes import InlineEpisodes
from megatron_apriel.actor.grouping import build_group
from megatron_apriel.actor.loop import Actor
from megatron_apriel.data.datasets import ProblemPools
from megatron_apriel.data.order import DomainOrder
from megatron_apriel.envs.registry import ENVIRONMENTS
from megatron_apriel.fleet.client import Completion, FleetClient
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.records.config import RolloutConfig
from megatron_apriel.records.lag import group_lag
from megatron_apriel.records.rollouts import GroupTimings, VersionSpan
from megatron_apriel.records.stream import (
    StreamReader,
    StreamWriter,
    TrainerProgress,
    list_segments,
    read_segment,
    segment_path,
    write_progress,
)
from megatron_apriel.rewards import RewardConfig
from megatron_apriel.sampling.domain_sampler import SamplerConfig
from megatron_apriel.testing.fake_fleet import ByteTokenizer, FakeFleet
from megatron_apriel.tiny.base import addition_problems
from megatron_apriel.verifiers import Outcome, VerifierResult
from megatron_apriel.verifiers.base import correct, failed


def make_actor(root, fleet, rollout, accuracy_seed=0, max_in_flight=8, count="completed"):
    pools = ProblemPools(addition_problems(4))
    cfg = ActorConfig(sampler=SamplerConfig(weights={"math": 1.0}, count=count), max_in_flight=max_in_flight,
                      flush_interval_s=0.01, poll_s=0.005)
    client = FleetClient(["http://fake-a", "http://fake-b"], transport=fleet.transport())

    rewards = RewardConfig(max_len=64, buffer=16)
    return Actor(cfg=cfg, rollout=rollout, rewards=rewards, sampling=SamplingConfig(max_tokens=64), client=client,
                 sampler=cfg.sampler.build(), order=DomainOrder(pools, seed=3), tokenizer=ByteTokenizer(),
                 stream=StreamWriter(root), episodes=InlineEpisodes(ENVIRONMENTS))


async def run_with_trainer(root, actor, fleet, rollout, steps):
    """A trainer that consumes ``groups_per_step`` usable groups per step and pushes a version."""
    stop = asyncio.Event()
    task = asyncio.create_task(actor.run(stop))
    reader, trained, step = StreamReader(root), [], 0
    write_progress(root, TrainerProgress(step=0, filled=0, cursor=0, version=0))
    while step < steps:
        taken = 0
        while taken < rollout.groups_per_step:
            group = reader.next_group()
            if group is None:
                write_progress(root, TrainerProgress(step=step, filled=taken, cursor=reader.cursor, version=step))
                await asyncio.sleep(0.002)
                continue
            if group.dropped:
                continue
            trained.append((step, group))
            taken += 1
        write_progress(root, TrainerProgress(step=step + 1, filled=0, cursor=reader.cursor, version=step))
        await asyncio.sleep(0.01)  # "training"; the actor keeps generating within the lag bound
        step += 1
        fleet.version = step  # the push
        write_progress(root, TrainerProgress(step=step, filled=0, cursor=reader.cursor, version=step))
    stop.set()
    await task
    await actor.client.aclose()
    return trained


@pytest.mark.parametrize("max_lag", [0, 2])
def test_actor_keeps_every_trained_group_within_max_lag(tmp_path, max_lag):
    fleet = FakeFleet(accuracy=0.5)
    rollout = RolloutConfig(group_size=4, groups_per_step=3, max_lag=max_lag)
    actor = make_actor(tmp_path, fleet, rollout)
    trained = asyncio.run(run_with_trainer(tmp_path, actor, fleet, rollout, steps=8))
    lags = [group_lag(step, g.min_version) for step, g in trained]
    assert len(trained) == 24 and max(lags) <= max_lag
    if max_lag:
        assert max(lags) > 0  # generation really ran ahead of training

    everything = StreamReader(tmp_path).read_all()
    assert [g.seq for g in everything] == list(range(len(everything)))
    # the sampler counted every finished rollout, dropped groups included, and apart those of the
    # groups to be trained: the stream and both its counts agree
    assert actor.sampler.counts() == {"math": sum(len(g.rollouts) for g in everything)}
    assert actor.sampler.counts("trained") == {"math": sum(len(g.rollouts) for g in everything if g.dropped is None)}
    assert actor.sampler.counts("trained") != actor.sampler.counts()  # accuracy 0.5: some groups were dropped
    snap = StreamWriter(tmp_path).last_snapshot()
    assert snap.sampler["counts"] == actor.sampler.counts()
    assert snap.sampler["trained"] == actor.sampler.counts("trained")
    # what was served, plus what was in flight when it stopped, is exactly a prefix of the data order
    # (not the stream's first groups: the stream is in completion order, and groups drawn one after
    # the other finish in any order, more so on a busy machine)
    served = Counter(g.problem_id for g in everything) + Counter(p.problem_id for p in snap.in_flight)
    order = DomainOrder(ProblemPools(addition_problems(4)), seed=3)
    assert served == Counter(order.next("math").id for _ in range(sum(served.values())))
    for g in everything:
        assert sum(r.advantage for r in g.rollouts) == pytest.approx(0.0, abs=1e-9)  # leave-one-out
        assert (g.dropped == "zero_advantage") == (len({r.reward for r in g.rollouts}) == 1)


def test_max_lag_zero_is_on_policy_even_with_filtered_groups(tmp_path):
    fleet = FakeFleet(accuracy=0.9)  # many all-correct groups: dropped, so the trainer asks for more
    rollout = RolloutConfig(group_size=2, groups_per_step=2, max_lag=0)
    trained = asyncio.run(run_with_trainer(tmp_path, make_actor(tmp_path, fleet, rollout), fleet, rollout, steps=5))
    assert {step - g.min_version for step, g in trained} == {0}


def completion(tokens, finish="stop"):
    return Completion(prompt_token_ids=[1], token_ids=tokens, logprobs=[-1.0] * len(tokens), finish_reason=finish,
                      versions=[VersionSpan(version=0, start=0, end=len(tokens))], server="s")


def test_build_group_rewards_dap_and_drop_rules():
    problem = addition_problems(1)[0]
    timings = GroupTimings(submitted_at=0.0, generate_s=0.0, verify_s=0.0)
    rewards = RewardConfig(max_len=10, buffer=4)
    comps = [completion([5] * 3), completion([5] * 8), completion([5] * 3), completion([5] * 10, finish="length")]
    results = [correct(), correct(), failed(Outcome.WRONG), correct()]

    def group(completions, verdicts):
        return build_group(problem=problem, prompt_ids=[1], completions=completions, results=verdicts, rewards=rewards,
                           admitted_version=0, timings=timings)

    g = group(comps, results)
    # R: correct and finished = 1; the truncated one earns nothing. s = 2/4 solved.
    # P(8) = (6 - 8)/4 = -0.5 scaled by s = 0.5 on a correct rollout; P(10) = -1 at full scale (hard cap)
    assert [r.reward for r in g.rollouts] == pytest.approx([1.0, 1.0 - 0.25, 0.0, -1.0])
    assert [r.success for r in g.rollouts] == [True, True, False, False] and g.dropped is None
    assert g.rollouts[0].advantage == pytest.approx(1.0 - (0.75 + 0.0 - 1.0) / 3)
    same = group(comps[:1] * 3, [failed(Outcome.WRONG)] * 3)
    assert same.dropped == "zero_advantage"
    crash = [correct(), VerifierResult(0.0, False, Outcome.VERIFIER_ERROR), failed(Outcome.WRONG)]
    assert group(comps[:3], crash).dropped == "verifier_error"


@pytest.mark.parametrize("count", ["completed", "trained"])
def test_resumed_actor_regenerates_its_in_flight_groups_first(tmp_path, count):
    fleet = FakeFleet(accuracy=0.5, max_delay_s=0.05)  # groups finish out of order, some stay in flight
    rollout = RolloutConfig(group_size=2, groups_per_step=2, max_lag=None)
    actor = make_actor(tmp_path, fleet, rollout, max_in_flight=6, count=count)
    asyncio.run(run_with_trainer(tmp_path, actor, fleet, rollout, steps=4))
    snap = StreamWriter(tmp_path).last_snapshot()
    assert snap.sampler["count"] == count
    again = make_actor(tmp_path, fleet, rollout, max_in_flight=6, count=count)
    pending = again.restore()
    assert [p.problem_id for p in pending] == [p.problem_id for p in snap.in_flight]
    kept = sum(len(g.rollouts) for g in StreamReader(tmp_path).read_all() if g.dropped is None)
    # the counts of what the stream holds, both of them, and the sampler's state exactly
    assert again.sampler.counts() == {"math": 2 * snap.next_seq} and again.sampler.counts("trained") == {"math": kept}
    assert again.sampler.state_dict() == snap.sampler
    # what it draws next continues the data order exactly where the snapshot left it
    order = DomainOrder(ProblemPools(addition_problems(4)), seed=3)
    order.load_state_dict(snap.order)
    assert [again.order.next("math").id for _ in range(5)] == [order.next("math").id for _ in range(5)]


def test_a_stream_of_the_previous_release_resumes_with_its_trained_counts_recounted(tmp_path):
    """A last segment whose sampler state is version 2 (no trained counts): the actor recounts
    them from the stream, and the completed counts and the RNG continue exactly."""
    fleet = FakeFleet(accuracy=0.5)
    rollout = RolloutConfig(group_size=2, groups_per_step=2, max_lag=None)
    asyncio.run(run_with_trainer(tmp_path, make_actor(tmp_path, fleet, rollout), fleet, rollout, steps=3))
    last = segment_path(tmp_path, list_segments(tmp_path)[-1])
    segment = read_segment(last)
    v3 = segment.actor.sampler
    v2 = {k: v for k, v in v3.items() if k not in ("trained", "count")} | {"version": 2}
    old = segment.model_copy(update={"actor": segment.actor.model_copy(update={"sampler": v2})})
    last.write_text(old.model_dump_json())
    again = make_actor(tmp_path, fleet, rollout)
    again.restore()
    assert again.sampler.state_dict() == v3 and 0 < v3["trained"]["math"] < v3["counts"]["math"]


def test_some_runs_stop_with_groups_in_flight(tmp_path):
    """The case the previous test guards is real: with slow generation a snapshot lists in-flight groups."""
    seen = 0
    for seed in range(4):
        fleet = FakeFleet(accuracy=0.5, max_delay_s=0.05, seed=seed)
        rollout = RolloutConfig(group_size=2, groups_per_step=2, max_lag=None)
        root = tmp_path / str(seed)
        asyncio.run(run_with_trainer(root, make_actor(root, fleet, rollout, max_in_flight=6), fleet, rollout, steps=3))
        seen += bool(StreamWriter(root).last_snapshot().in_flight)
    assert seen > 0


def test_while_the_trainer_is_down_the_actor_stops_at_its_backlog_cap(tmp_path):
    fleet = FakeFleet(accuracy=1.0)  # every group all-correct: all dropped, none usable
    rollout = RolloutConfig(group_size=2, groups_per_step=3, max_lag=None)
    actor = make_actor(tmp_path, fleet, rollout, max_in_flight=8)
    actor.cfg.max_queued_steps = 2

    async def go():
        write_progress(tmp_path, TrainerProgress(step=0, filled=0, cursor=0, version=0))  # then the trainer is gone
        stop = asyncio.Event()
        task = asyncio.create_task(actor.run(stop))
        await asyncio.sleep(1.0)
        stop.set()
        await task
        await actor.client.aclose()

    asyncio.run(go())
    written = StreamWriter(tmp_path).next_seq
    assert written == 2 * 3 and fleet.requests == written  # capped, and nothing generated beyond the cap
