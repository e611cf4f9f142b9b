"""The actor: an asyncio loop that turns problems into scored rollout groups in the stream.

    sampler picks a domain -> next problem of that domain (seeded order) -> its environment starts
    G episodes (in an episode worker) -> their first messages through the served model's chat
    template, once -> FleetClient.generate(n=G) -> each turn's text to its episode (one batched
    step) -> rollouts the environment answers go on, each on its own, token in and token out ->
    scores -> task rewards, length penalty with DAP, advantages, zero-advantage filter -> the stream

Every domain runs through an environment (``envs/``): a single-turn one (a verifier: the episode
ends after the first turn, whose step answers with the verifier's result) is the case of one
turn. A multi-turn rollout continues from the ids already there: the reply's chat-template ids
alone are appended after the sampled ones (``actor/trajectory.py``), then the next turn is asked
for with the whole id sequence; nothing the model sampled is decoded and encoded again. Limits:
``actor.max_turns`` and ``actor.max_trajectory_tokens``; a trajectory stopped by either is
truncated and scored as it is. Episodes live in dedicated processes (``actor/episodes.py``), so
tool calls never block the event loop.

Many groups are in flight at once (``actor.max_in_flight``). Admission control
(``records/lag.py``) reads the trainer's published progress and starts a group only if it will be
trained within ``rollout.max_lag`` versions of the weights it is sampled with, and never lets more
than ``actor.max_queued_steps`` steps' worth of groups wait ahead of the trainer. Groups ahead of
it that the trainer will skip (dropped by the filters) do not count: only those in flight, whose
fate is unknown, are counted as if they will be trained, so the bound stays exact and the actor
does not sit idle while most groups are filtered (an easy dataset). The sampler
counts each finished rollout (a group adds G), and whether its group will be trained: it steers
by the completed counts, as the recipe says, or by the trained ones (``actor.sampler.count``).
Groups are written as they finish (batched per ``flush_interval_s``), each segment with a snapshot
of the actor's state (both counts among it), from which a restarted actor continues: it
regenerates the groups that were in flight.

Groups the trainer must not learn from are still written, marked ``dropped`` (their rollouts did
complete, so the sampler and the stream agree): ``zero_advantage`` (every advantage ~0, dynamic
sampling) and ``verifier_error`` (a verifier crashed on one of its rollouts: the verdict is not
the model's, so the whole group is left out, and counted, rather than trained on a biased
baseline). Neither counts as trained.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable, Optional

from megatron_apriel.actor.config import ActorConfig
from megatron_apriel.actor.episodes import EpisodesLost
from megatron_apriel.actor.grouping import build_group
from megatron_apriel.actor.trajectory import ChatTokens, Trajectory
from megatron_apriel.actor.turns import Turns
from megatron_apriel.data.order import DomainOrder
from megatron_apriel.envs.base import Start
from megatron_apriel.fleet.client import FleetClient, FleetUnavailable
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.records.config import RolloutConfig
from megatron_apriel.records.lag import may_admit
from megatron_apriel.records.rollouts import DETAIL_CHARS, GroupTimings, Outcome, RolloutGroup
from megatron_apriel.records.stream import (
    ActorSnapshot,
    PendingGroup,
    StreamReader,
    StreamWriter,
    TrainerProgress,
    read_progress,
)
from megatron_apriel.rewards import RewardConfig
from megatron_apriel.sampling.domain_sampler import AdaptiveDomainSampler, state_from_v2

log = logging.getLogger("megatron_apriel.actor")


class Actor:
    def __init__(self, *, cfg: ActorConfig, rollout: RolloutConfig, rewards: RewardConfig, sampling: SamplingConfig,
                 client: FleetClient, sampler: AdaptiveDomainSampler, order: DomainOrder, tokenizer,
                 stream: StreamWriter, episodes, metrics=None, members: Optional[Callable] = None):
        """``episodes``: where the episodes live (``actor/episodes.py``: ``EpisodeWorkers``, or
        ``InlineEpisodes`` for tests); ``members()``, if given, lists the fleet as (url, instance)
        pairs (``run_dir/fleet``): a new server is used, a restarted one is asked for its version
        before it gets requests."""
        self.cfg, self.rollout, self.rewards, self.sampling = cfg, rollout, rewards, sampling
        self.client, self.sampler, self.order, self.tokenizer = client, sampler, order, tokenizer
        self.stream, self.episodes, self.metrics, self.members = stream, episodes, metrics, members
        self.chat = ChatTokens(tokenizer)
        self.turns = Turns(client, self.chat, episodes, max_turns=cfg.max_turns,
                           budget=cfg.max_trajectory_tokens or sampling.max_tokens)
        self._instances: dict[str, str] = {}
        self._regenerate: list[PendingGroup] = []
        self._usable_written: collections.deque[int] = collections.deque()
        """Sequence numbers of written groups the trainer will train (not dropped), not yet read."""
        self._scan_backlog = False
        self._last_members = 0.0
        self.tasks: dict[asyncio.Task, PendingGroup] = {}
        self.finished: list[RolloutGroup] = []
        self.progress: Optional[TrainerProgress] = None
        """The trainer's last published progress; nothing is generated before the first one (the
        trainer publishes it once the fleet serves its weights)."""
        self.stats = {"groups": 0, "tokens": 0, "skipped_prompts": 0, "fleet_retries": 0, "episode_retries": 0,
                      "groups_lost": 0, "turns": 0, "truncated": 0}
        self._lost: collections.Counter = collections.Counter()
        """Problems whose episodes a dying worker took, and how often."""
        self._t0 = time.monotonic()
        self._last_flush = self._last_metrics = time.monotonic()

    # -- state ---------------------------------------------------------------------------------
    def snapshot(self) -> ActorSnapshot:
        return ActorSnapshot(next_seq=self.stream.next_seq + len(self.finished), sampler=self.sampler.state_dict(),
                             order=self.order.state_dict(), in_flight=list(self.tasks.values()))

    def restore(self) -> list[PendingGroup]:
        """Continue from the stream's last snapshot; returns the groups to regenerate first."""
        snap = self.stream.last_snapshot()
        if snap is None:
            return []
        self._scan_backlog = True  # once the trainer's cursor is known: which written groups it will train
        self.sampler.load_state_dict(self._sampler_state(snap))
        self.order.load_state_dict(snap.order)
        log.info("resumed at group %d (%d in flight regenerated)", snap.next_seq, len(snap.in_flight))
        return list(snap.in_flight)

    def _sampler_state(self, snap: ActorSnapshot) -> dict:
        """The snapshot's sampler state; one written before the trained counts (version 2) gets
        them recounted from the groups of the stream up to it (read once, at this resume)."""
        if snap.sampler.get("version") != 2:
            return snap.sampler
        log.info("the stream's sampler state predates the trained counts: recounting them from its %d groups",
                 snap.next_seq)
        trained, reader = collections.Counter(), StreamReader(self.stream.root)
        while (group := reader.next_group()) is not None:
            if group.dropped is None:
                trained[group.domain] += len(group.rollouts)
        return state_from_v2(snap.sampler, trained)

    # -- one group -----------------------------------------------------------------------------
    async def _group(self, pending: PendingGroup) -> Optional[RolloutGroup]:
        problem = self.order.get(pending.problem_id)
        env = self.cfg.environment(problem.domain, problem.metadata)
        keys, start = await self.episodes.open(env, problem, self.rollout.group_size)
        try:
            return await self._episodes(pending, problem, keys, start)
        except BaseException:
            self.episodes.discard(keys)
            raise

    async def _episodes(self, pending: PendingGroup, problem, keys: list[str], start: Start) -> Optional[RolloutGroup]:
        prompt = self.chat.prompt(start.messages, start.tools)
        if len(prompt) > self.cfg.max_prompt_tokens:
            log.warning("problem %s: prompt of %d tokens > actor.max_prompt_tokens=%d, skipped", problem.id,
                        len(prompt), self.cfg.max_prompt_tokens)
            self.stats["skipped_prompts"] += 1
            self.episodes.discard(keys)
            return None
        submitted, t0 = time.time(), time.monotonic()
        completions = await self.client.generate(prompt, self.turns.sampling(self.sampling, 0),
                                                 n=self.rollout.group_size)
        t1 = time.monotonic()
        trajectories = [Trajectory.single(c, len(prompt)) for c in completions]
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        answers = await self.episodes.step(list(zip(keys, texts)))  # the first turns, one call
        t2 = time.monotonic()
        results = await asyncio.gather(*(self.turns.rest(key, t, prompt, start, text, answer, self.sampling)
                                         for key, t, text, answer in zip(keys, trajectories, texts, answers)))
        for r in results:
            if r.outcome is Outcome.VERIFIER_ERROR:
                log.error("problem %s (%s): the verifier failed, the group is dropped: %s", problem.id, problem.domain,
                          r.detail[:DETAIL_CHARS])
        self.stats["turns"] += sum(len(t.turns) for t in trajectories)
        self.stats["truncated"] += sum(t.truncated for t in trajectories)
        timings = GroupTimings(submitted_at=submitted, generate_s=t1 - t0 + max(time.monotonic() - t2, 0.0),
                               verify_s=t2 - t1)
        return build_group(problem=problem, prompt_ids=prompt, completions=trajectories, results=results,
                           rewards=self.rewards, admitted_version=pending.admitted_version, timings=timings)

    def _start(self, pending: PendingGroup) -> None:
        self.tasks[asyncio.create_task(self._group(pending))] = pending

    def _queued(self) -> tuple[int, int]:
        """Groups ahead of a new one that the trainer will train (or may: those in flight), and the
        whole backlog (dropped groups included)."""
        while self._usable_written and self._usable_written[0] < self.progress.cursor:
            self._usable_written.popleft()
        usable = len(self._usable_written) + sum(g.dropped is None for g in self.finished) + len(self.tasks)
        backlog = self.stream.next_seq - self.progress.cursor + len(self.finished) + len(self.tasks)
        return usable, backlog

    def _admit(self) -> None:
        if self.progress is None:
            return
        while self._regenerate:  # admitted before a restart: they go first, whatever the bound, sampled now
            self._start(self._regenerate.pop(0).model_copy(update={"admitted_version": self.progress.version}))
        queued, backlog = self._queued()
        max_queued = self.cfg.max_queued_steps * self.rollout.groups_per_step
        oldest = min((p.admitted_version for p in self.tasks.values()), default=None)
        while len(self.tasks) < self.cfg.max_in_flight and may_admit(
                self.progress, queued=queued, groups_per_step=self.rollout.groups_per_step,
                max_lag=self.rollout.max_lag, max_queued=max_queued, oldest_in_flight=oldest, backlog=backlog):
            problem = self.order.next(self.sampler.sample())
            self._start(PendingGroup(problem_id=problem.id, domain=problem.domain,
                                     admitted_version=self.progress.version))
            queued, backlog = queued + 1, backlog + 1
            oldest = self.progress.version if oldest is None else oldest

    def _collect(self, done: set[asyncio.Task]) -> None:
        for task in done:
            pending = self.tasks.pop(task)
            try:
                group = task.result()
            except FleetUnavailable as err:  # no server answered in time: try the same problem again
                log.warning("group for %s failed on the fleet (%s); sending it again", pending.problem_id, err)
                self.stats["fleet_retries"] += 1
                self._start(pending)
                continue
            except EpisodesLost as err:  # its episode worker died (replaced): once more, then give it up
                self._lost[pending.problem_id] += 1
                if self._lost[pending.problem_id] > 1:
                    log.error("group for %s lost its episodes twice (%s): dropped; its environment or verifier may "
                              "crash its worker", pending.problem_id, err)
                    self.stats["groups_lost"] += 1
                    continue
                log.warning("group for %s lost its episodes (%s); starting it again", pending.problem_id, err)
                self.stats["episode_retries"] += 1
                self._start(pending)
                continue
            if group is None:
                continue
            self.sampler.record_completion(group.domain, len(group.rollouts), trained=group.dropped is None)
            self.finished.append(group)
            self.stats["groups"] += 1
            self.stats["tokens"] += sum(r.length for r in group.rollouts)

    def _flush(self, force: bool = False) -> None:
        trainer_waits = self.progress is not None and self.progress.cursor >= self.stream.next_seq
        due = time.monotonic() - self._last_flush >= self.cfg.flush_interval_s
        if self.finished and (force or due or trainer_waits or not self.tasks):
            written = self.stream.append(self.finished, self.snapshot())
            self._usable_written.extend(g.seq for g in written if g.dropped is None)
            self.finished = []
            self._last_flush = time.monotonic()

    def _refresh_progress(self) -> None:
        progress = read_progress(self.stream.root)
        if progress is not None:
            self.progress = progress
            self.client.required_version = progress.version
            if self._scan_backlog:
                self._scan_backlog = False
                reader = StreamReader(self.stream.root, cursor=progress.cursor)  # at most the backlog cap
                while (group := reader.next_group()) is not None:
                    if group.dropped is None:
                        self._usable_written.append(group.seq)

    def _refresh_members(self, every_s: float = 2.0) -> None:
        if self.members is None or time.monotonic() - self._last_members < every_s:
            return
        self._last_members = time.monotonic()
        members = dict(self.members())
        for url, instance in members.items():
            known = self._instances.get(url)
            if known is None:
                self.client.add_server(url)
            elif known != instance:
                log.warning("server %s restarted (new instance); it gets requests once it serves the current "
                            "weights", url)
                self.client.mark_restarted(url)
            self._instances[url] = instance
        for url in sorted(set(self._instances) - set(members)):  # its registration is gone: retired
            log.warning("server %s left the fleet (its registration was withdrawn); it gets no more requests", url)
            self.client.remove_server(url)
            del self._instances[url]

    def _log_metrics(self) -> None:
        now = time.monotonic()
        if self.metrics is None or now - self._last_metrics < self.cfg.metrics_every_s:
            return
        elapsed = now - self._t0
        m = {"actor/in_flight": float(len(self.tasks)), "actor/groups_written": float(self.stream.next_seq),
             "actor/gen_tokens_per_s": self.stats["tokens"] / elapsed,
             "actor/skipped_prompts": float(self.stats["skipped_prompts"]),
             "actor/fleet_retries": float(self.stats["fleet_retries"]),
             "actor/episode_retries": float(self.stats["episode_retries"]),
             "actor/groups_lost": float(self.stats["groups_lost"]),
             "actor/turns_per_rollout": self.stats["turns"] / max(self.stats["groups"] * self.rollout.group_size, 1),
             "actor/truncated": float(self.stats["truncated"])}
        m.update({f"actor/p/{d}": p for d, p in self.sampler.probabilities().items()})
        self.metrics.log(m, self.progress.step if self.progress else 0)
        self._last_metrics = now

    # -- the loop ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Generate until ``stop`` is set; then write what finished and cancel the rest."""
        self._regenerate = self.restore()
        try:
            while not stop.is_set():
                self._refresh_progress()
                self._refresh_members()
                self._admit()
                if self.tasks:
                    done, _ = await asyncio.wait(self.tasks, timeout=self.cfg.poll_s,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    self._collect(done)
                else:
                    await asyncio.sleep(self.cfg.poll_s)
                self._flush()
                self._log_metrics()
        finally:
            for task in self.tasks:
                task.cancel()
            for pending, result in zip(self.tasks.values(), await asyncio.gather(*self.tasks, return_exceptions=True)):
                if isinstance(result, Exception):
                    log.error("group for %s failed while stopping: %r", pending.problem_id, result)
            self._flush(force=True)


