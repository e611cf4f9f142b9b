"""An episode worker that dies (SIGKILL, as the OOM killer would) is replaced: the call that
reaches it raises ``EpisodesLost``, the episodes it held are forgotten, the next episodes run on a
fresh worker; the actor starts a group whose episodes were lost once more, and drops a problem
that loses them twice."""

import asyncio
import functools
import signal

import psutil
import pytest

from megatron_apriel.actor.episodes import EpisodesLost, EpisodeWorkers, InlineEpisodes
from megatron_apriel.envs.config import EnvsConfig, ToolCallConfig
from megatron_apriel.envs.registry import build_environments
from megatron_apriel.records.rollouts import Outcome, Problem
from megatron_apriel.testing.fake_envs import hanging_environments
from megatron_apriel.testing.fake_fleet import FakeToolFleet
from tests.unit.actor.test_multiturn import make_actor, run_groups, sum_policy, tokenizer  # noqa: F401 (fixture)

PROBLEM = Problem(id="p", domain="math", prompt=[{"role": "user", "content": "Echo."}], reference={})


def worker_pids(workers: EpisodeWorkers) -> list[int]:
    return [pid for pool in workers.pools for pid in pool._processes]  # the executor's own table


def test_a_dead_worker_is_replaced_and_its_episodes_are_lost():
    async def scenario():
        workers = EpisodeWorkers(1, functools.partial(hanging_environments, 0.5))
        try:
            keys, _ = await workers.open("hang", PROBLEM, 2)
            [pid] = worker_pids(workers)
            psutil.Process(pid).send_signal(signal.SIGKILL)
            psutil.Process(pid).wait(timeout=30)
            with pytest.raises(EpisodesLost, match="episode worker 0 died"):
                await workers.step([(keys[0], "[echo(text='hi')]")])
            assert workers.restarts == 1 and workers.live() == 0
            workers.discard(keys)  # what the actor does next: nothing left to drop
            keys, _ = await workers.open("hang", PROBLEM, 1)
            [answer] = await workers.step([(keys[0], "[echo(text='hi')]")])
            assert answer.reply.messages[0]["content"] == "hi" and worker_pids(workers) != [pid]
            assert workers.restarts == 1
        finally:
            workers.shutdown()

    asyncio.run(scenario())


class LosingEpisodes(InlineEpisodes):
    """Inline episodes whose ``open`` loses the episodes of the problems in ``lose`` (``times``
    times each), as a dying worker would."""

    def __init__(self, lose: set[str], times: int):
        super().__init__(build_environments(EnvsConfig(calls=ToolCallConfig(isolate=False))))
        self.lose, self.times, self.lost = lose, times, []

    async def open(self, env, problem, n):
        if problem.id in self.lose and self.lost.count(problem.id) < self.times:
            self.lost.append(problem.id)
            raise EpisodesLost("episode worker 0 died (test)")
        return await super().open(env, problem, n)


@pytest.mark.parametrize("times", [1, 2])
def test_the_actor_starts_a_lost_group_again_once(tmp_path, tokenizer, times):  # noqa: F811 (fixture)
    episodes = LosingEpisodes({"sum3-0", "sum3-1"}, times)
    actor = make_actor(tmp_path, FakeToolFleet(tokenizer, sum_policy, split_p=0.0), tokenizer, episodes=episodes,
                       environments={"math": "arithmetic"})
    groups = run_groups(tmp_path, actor, 14)  # every problem of 12, and then some
    written = {g.problem_id for g in groups}
    assert sorted(episodes.lost) == sorted(["sum3-0", "sum3-1"] * times)
    assert actor.stats["episode_retries"] == 2
    assert actor.stats["groups_lost"] == (2 if times == 2 else 0)
    assert ({"sum3-0", "sum3-1"} <= written) == (times == 1)
    assert all(len(g.rollouts) == 4 and all(r.outcome is not Outcome.VERIFIER_ERROR for r in g.rollouts)
               for g in groups)
