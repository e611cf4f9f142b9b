"""The turns of one episode after its first, token in and token out: what the actor runs for each
rollout of a group, and ``apriel-eval`` for each sample of a multi-turn benchmark.

    turns = Turns(client, chat, episodes, max_turns=16, budget=4096)
    result = await turns.rest(key, t, prompt, start, text, answer, sampling)

Until the environment ends the episode: the reply's chat-template ids are appended after the
sampled ones (``ChatTokens.between``), the next turn is asked for with the whole id sequence,
its text goes to the episode. A limit stops it, recorded ``truncated`` and scored as it is (the
environment's ``score`` on what is there): ``max_turns`` model turns, ``budget`` ids after the
prompt (model and environment ids alike), an empty turn, or a turn cut at its length limit.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from megatron_apriel.actor.episodes import Answer
from megatron_apriel.actor.trajectory import ChatTokens, Trajectory
from megatron_apriel.envs.base import Start
from megatron_apriel.fleet.client import FleetClient
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers.base import VerifierResult


class EpisodeHost(Protocol):
    """``EpisodeWorkers`` or ``InlineEpisodes`` (``actor/episodes.py``)."""

    async def open(self, env: str, problem: Problem, n: int) -> tuple[list[str], Start]: ...

    def discard(self, keys: list[str]) -> None: ...

    async def step(self, items: list[tuple[str, str]]) -> list[Answer]: ...

    async def close(self, keys: list[str]) -> list[VerifierResult]: ...


@dataclasses.dataclass
class Turns:
    client: FleetClient
    chat: ChatTokens
    episodes: EpisodeHost
    max_turns: int
    budget: int
    """Ids of one trajectory after its prompt (``actor.max_trajectory_tokens``, else one turn's)."""

    def sampling(self, base: SamplingConfig, used: int) -> SamplingConfig:
        """One turn's request: at most what is left of the trajectory's budget."""
        left = self.budget - used
        return base if left >= base.max_tokens else dataclasses.replace(base, max_tokens=left)

    async def rest(self, key: str, t: Trajectory, prompt: list[int], start: Start, text: str, answer: Answer,
                   sampling: SamplingConfig) -> VerifierResult:
        """The turns after the first (``t`` holds it, ``text`` its text, ``answer`` the episode's
        reply), until the episode ends or a limit stops it; returns the episode's score."""
        history = list(start.messages)
        while not answer.reply.done:
            last = t.last_ids
            if not last or t.finish_reason == "length" or len(t.turns) >= self.max_turns:
                t.truncated = True
                break
            between = self.chat.between(history, start.tools, answer.reply.messages, last)
            if len(t.ids) + len(between) + 1 > self.budget:
                t.truncated = True
                break
            history += [{"role": "assistant", "content": text}, *answer.reply.messages]
            t.add_environment(between)
            completion = (await self.client.generate(prompt + t.ids, self.sampling(sampling, len(t.ids)), n=1))[0]
            t.add_turn(completion)
            text = self.chat.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            answer = (await self.episodes.step([(key, text)]))[0]
        t.finish()
        if answer.reply.done:
            return answer.result
        return (await self.episodes.close([key]))[0]
