"""Multi-turn rollouts in the actor: its own time per turn, and whether tool execution ever holds
up generation.

    PYTHONPATH=. python benchmarks/multiturn.py [--groups 200] [--tool-s 0.05]

Both parts run the real Actor, FleetClient and stream writer against ``FakeToolFleet`` (the tiny
model's real tokenizer and chat template; the fake model writes the turns), with a stream reader
playing the trainer in the same loop.

1. The actor's own time per model turn: the arithmetic environment's calculator inline (no fork),
   an instant fleet; three model turns per trajectory (two tool calls, then the answer). Per turn:
   wall time, less the fleet's time making answers and the environment's time stepping. Target:
   below 1 ms.
2. Generation throughput with tools that take time against the same run with tools answered at
   once. The fleet is a server of 4 concurrent generations of ``--generation-s`` each (20 ms), so
   it has a capacity to keep busy; each trajectory calls ``sleep(seconds=TOOL_S)`` and ``echo`` and then answers.
   - tools: episodes in ``--workers`` worker processes (2), each call forked with a time limit, as
     in a run (a worker runs one episode's calls at a time: with slow tools, the workers are the
     capacity to compare with the fleet's);
   - instant: the same tools in this process, the sleep answered at once;
   - blocking (the measurement's own check): the sleep run inline, in the event loop, as a naive
     actor would; its throughput shows what blocking costs.
   Target: tools / instant at least 0.9.
Ratios are of figures measured in this one run. No assertions: numbers only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import tempfile
import time
from pathlib import Path

from megatron_apriel.actor.config import ActorConfig
from megatron_apriel.actor.episodes import EpisodeWorkers, InlineEpisodes
from megatron_apriel.actor.loop import Actor
from megatron_apriel.data.datasets import ProblemPools
from megatron_apriel.data.order import DomainOrder
from megatron_apriel.envs.config import EnvsConfig, ToolCallConfig
from megatron_apriel.envs.registry import build_environments
from megatron_apriel.fleet.client import FleetClient
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.records.config import RolloutConfig
from megatron_apriel.records.rollouts import Problem
from megatron_apriel.records.stream import StreamWriter
from megatron_apriel.rewards import RewardConfig
from megatron_apriel.sampling.domain_sampler import SamplerConfig
from megatron_apriel.testing.fake_envs import HangingEnvironment, hanging_environments
from megatron_apriel.testing.fake_fleet import FakeToolFleet, calculator_policy
from megatron_apriel.testing.fake_trainer import run_until_read
from megatron_apriel.tiny.model import TinySpec, build_tokenizer

GROUP_SIZE, PER_STEP = 4, 16


def sum_problems(n: int) -> list[Problem]:
    return [Problem(id=f"sum3-{i}", domain="math", prompt=[{"role": "user", "content": f"What is {i} + {i + 1} + "
                                                            f"{2 * i}? Use the calculator."}],
                    reference={"answer": 4 * i + 1}, metadata={"environment": "arithmetic"}) for i in range(n)]


def tool_policy(seconds: float, context: str) -> str:
    return "done" if "<|tool|>" in context else f"[sleep(seconds={seconds}), echo(text='hi')]"


class TimedEpisodes(InlineEpisodes):
    """Inline episodes that add up their own time (the environment's, not the actor's)."""

    def __init__(self, environments):
        super().__init__(environments)
        self.busy_s = 0.0

    @contextlib.contextmanager
    def _timed(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - t0

    async def open(self, env, problem, n):
        with self._timed():
            return await super().open(env, problem, n)

    async def step(self, items):
        with self._timed():
            return await super().step(items)

    async def close(self, keys):
        with self._timed():
            return await super().close(keys)


async def run_actor(root: Path, fleet, tokenizer, episodes, problems, groups: int, **cfg) -> tuple[Actor, float]:
    """Until ``groups`` groups are read back; the actor and the wall seconds."""
    cfg = ActorConfig(sampler=SamplerConfig(weights={"math": 1.0}), max_in_flight=16, flush_interval_s=0.05,
                      poll_s=0.001, max_trajectory_tokens=512, **cfg)
    actor = Actor(cfg=cfg, rollout=RolloutConfig(group_size=GROUP_SIZE, groups_per_step=PER_STEP, max_lag=None),
                  rewards=RewardConfig(max_len=64, buffer=16), sampling=SamplingConfig(max_tokens=64),
                  client=FleetClient(["http://fake"], transport=fleet.transport()), sampler=cfg.sampler.build(),
                  order=DomainOrder(ProblemPools(problems), seed=0), tokenizer=tokenizer, stream=StreamWriter(root),
                  episodes=episodes)
    elapsed = await run_until_read(actor, root, groups, PER_STEP)
    await actor.client.aclose()
    return actor, elapsed


def per_turn(tokenizer, groups: int) -> dict:
    episodes = TimedEpisodes(build_environments(EnvsConfig(calls=ToolCallConfig(isolate=False))))
    fleet = FakeToolFleet(tokenizer, calculator_policy, split_p=0.3)
    with tempfile.TemporaryDirectory() as tmp:
        actor, elapsed = asyncio.run(run_actor(Path(tmp), fleet, tokenizer, episodes, sum_problems(50), groups,
                                               environments={"math": "arithmetic"}))
    turns = actor.stats["turns"]
    own = elapsed - fleet.busy_s - episodes.busy_s
    return {"turns": turns, "wall_s": elapsed, "fleet_s": fleet.busy_s, "env_s": episodes.busy_s,
            "ms_per_turn": 1e3 * own / turns}


def throughput(tokenizer, groups: int, tool_s: float, kind: str, workers_n: int, generation_s: float) -> float:
    """Generated tokens per second of wall time, for ``kind`` tools/instant/blocking."""
    problems = [Problem(id=f"t{i}", domain="math", prompt=[{"role": "user", "content": "Sleep, then echo."}],
                        reference={}) for i in range(50)]
    workers = None
    if kind == "tools":
        workers = episodes = EpisodeWorkers(workers_n, functools.partial(hanging_environments, 10.0))
        policy = functools.partial(tool_policy, tool_s)
    else:
        episodes = InlineEpisodes({"hang": HangingEnvironment(ToolCallConfig(isolate=False))})
        policy = functools.partial(tool_policy, tool_s if kind == "blocking" else 0)
    fleet = FakeToolFleet(tokenizer, policy, split_p=0.3, slots=4, generation_s=generation_s)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _, elapsed = asyncio.run(run_actor(Path(tmp), fleet, tokenizer, episodes, problems, groups,
                                               environments={"math": "hang"}))
    finally:
        if workers is not None:
            workers.shutdown()
    return fleet.tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=200, help="groups per measurement")
    parser.add_argument("--tool-s", type=float, default=0.05, help="each tool call's own time (the sleep)")
    parser.add_argument("--workers", type=int, default=2, help="episode worker processes of the 'tools' run")
    parser.add_argument("--generation-s", type=float, default=0.02,
                        help="one generation's time on the fake server of 4 slots")
    args = parser.parse_args()
    tokenizer = build_tokenizer(TinySpec())
    t = per_turn(tokenizer, args.groups)
    print(f"actor's own time: {t['ms_per_turn']:.3f} ms per model turn over {t['turns']} turns "
          f"(wall {t['wall_s']:.2f} s, fleet {t['fleet_s']:.2f} s, environment {t['env_s']:.2f} s); target < 1 ms")
    rates = {kind: throughput(tokenizer, args.groups, args.tool_s, kind, args.workers, args.generation_s)
             for kind in ("instant", "tools", "blocking")}
    for kind, rate in rates.items():
        print(f"{kind:8s}: {rate:8.0f} generated tokens/s")
    print(f"tools / instant: x{rates['tools'] / rates['instant']:.2f} (target >= 0.9); "
          f"blocking / instant: x{rates['blocking'] / rates['instant']:.2f}")


if __name__ == "__main__":
    main()
