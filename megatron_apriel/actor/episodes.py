"""Where the actor's episodes live: every step of one episode reaches the process that holds it.

    host = EpisodeWorkers(workers=4, factory=functools.partial(environments_for_run, envs, verifiers))
    keys, start = await host.open("arithmetic", problem, n=8)     # G episodes of one problem
    answers = await host.step([(keys[0], text0), (keys[1], text1)])  # Answer(reply, result) each
    results = await host.close(keys[2:])                          # stopped early: scored as they are

Why dedicated processes (``EpisodeWorkers``): an episode is stateful (its tools' instances), so it
cannot go to whichever worker of a ``ProcessPoolExecutor`` is free; and its tool calls fork a
child each (``envs/isolation.py``), which needs a single-threaded process whose children nobody
else reaps. The actor process is neither (httpx, the executors' threads). So each worker is a
``ProcessPoolExecutor`` of one spawn process (the verifier pool's rules: stop signals left to the
owner, dies with it), single-threaded, holding its episodes in a dict by key; a group's G
episodes go to the worker with the fewest live episodes and stay there. The actor only awaits:
a tool that hangs holds its worker up to the call's time limit (``envs.calls.timeout_s``), never
the event loop. Single-turn domains take the same path (one ``open``, one batched ``step`` whose
answer carries the verifier's result): the verification of a group is one call into one worker,
as it was with the verifier pool.

A worker that dies (killed by the kernel's OOM killer, or a crash in native code) takes its
episodes with it: the next call that reaches it raises ``EpisodesLost``, the worker is replaced by
a fresh one, and the actor starts those groups again (once per problem; see ``actor/loop.py``).

``InlineEpisodes`` runs the same operations in the calling process (tests and benchmarks with
trusted, instant environments: a slow step would block the loop there).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import signal
import traceback
import uuid
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from megatron_apriel.envs.base import Environment, Episode, Reply, Start, score_episode
from megatron_apriel.records.rollouts import Outcome, Problem
from megatron_apriel.verifiers.base import VerifierResult, failed

log = logging.getLogger("megatron_apriel")


class EpisodesLost(RuntimeError):
    """An episode worker died: the episodes it held are gone (it has been replaced)."""


@dataclass(frozen=True)
class Answer:
    """The environment's answer to one model turn; ``result`` (its score) when it ended the episode."""

    reply: Reply
    result: Optional[VerifierResult] = None


class _Held:
    """The episodes of one process, and the operations on them (a worker's, or inline)."""

    def __init__(self, environments: Mapping[str, Environment]):
        self.environments = environments
        self.episodes: dict[str, Episode] = {}

    def open(self, env: str, problem: Problem, keys: list[str]) -> Start:
        if env not in self.environments:
            raise ValueError(f"unknown environment {env!r}; registered: {sorted(self.environments)}.")
        episodes = [self.environments[env].start(problem) for _ in keys]
        first = episodes[0].first
        if any(e.first != first for e in episodes[1:]):
            raise ValueError(f"environment {env!r} starts the episodes of {problem.id} differently; the G rollouts "
                             "of a group share one prompt.")
        self.episodes.update(zip(keys, episodes))
        return first

    def step(self, items: list[tuple[str, str]]) -> list[Answer]:
        out = []
        for key, text in items:
            episode = self.episodes[key]
            try:
                reply = episode.step(text)
            except Exception as err:  # the environment's own failure, not the model's
                tail = "".join(traceback.format_exception(err)[-3:])
                del self.episodes[key]
                out.append(Answer(Reply.end(), failed(Outcome.VERIFIER_ERROR, f"step failed: {err}\n{tail}"[:2000])))
                continue
            if reply.done:
                out.append(Answer(reply, score_episode(self.episodes.pop(key))))
            else:
                out.append(Answer(reply))
        return out

    def close(self, keys: list[str]) -> list[VerifierResult]:
        return [score_episode(self.episodes.pop(key)) for key in keys]

    def discard(self, keys: list[str]) -> None:
        for key in keys:
            self.episodes.pop(key, None)


class InlineEpisodes:
    """The episodes in this process (see the module docstring)."""

    def __init__(self, environments: Mapping[str, Environment]):
        self.held = _Held(environments)
        self.environments = environments

    async def open(self, env: str, problem: Problem, n: int) -> tuple[list[str], Start]:
        keys = [uuid.uuid4().hex for _ in range(n)]
        return keys, self.held.open(env, problem, keys)

    async def step(self, items: list[tuple[str, str]]) -> list[Answer]:
        return self.held.step(items)

    async def close(self, keys: list[str]) -> list[VerifierResult]:
        return self.held.close(keys)

    def discard(self, keys: list[str]) -> None:
        self.held.discard(keys)

    def live(self) -> int:
        return len(self.held.episodes)

    def shutdown(self) -> None:
        pass


# --- in a worker process ----------------------------------------------------------------------
_HELD: Optional[_Held] = None


def _worker_init(factory: Callable[[], Mapping[str, Environment]]) -> None:
    """A worker leaves SIGTERM/SIGINT to its owner (which shuts it down), dies with it, and builds
    its environments once."""
    from megatron_apriel.lifetime import die_with_parent

    global _HELD
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    _HELD = _Held(factory())


def _call(op: str, *args):
    return getattr(_HELD, op)(*args)


def environments_for_run(envs_settings=None, verifier_settings=None) -> Mapping[str, Environment]:
    """Every registered environment, with the run's settings (the default factory of a worker)."""
    from megatron_apriel.envs.registry import build_environments
    from megatron_apriel.verifiers.registry import build_verifiers

    verifiers = None if verifier_settings is None else build_verifiers(verifier_settings)
    return build_environments(envs_settings, verifiers)


class EpisodeWorkers:
    """Episodes in ``workers`` dedicated single-threaded processes (module docstring)."""

    def __init__(self, workers: int, factory: Callable[[], Mapping[str, Environment]] = environments_for_run):
        """``factory`` (picklable: a module-level function or a partial of one) builds each worker's
        environments by name."""
        if workers < 1:
            raise ValueError("EpisodeWorkers needs at least one worker.")
        self._factory = factory
        self.pools = [self._new_pool() for _ in range(workers)]
        self.home: dict[str, int] = {}
        """Each live episode's worker."""
        self._load = [0] * workers
        self._tie = itertools.count()
        self.restarts = 0
        """Workers replaced after they died."""

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_init, initargs=(self._factory,))

    async def _run(self, worker: int, op: str, *args):
        pool = self.pools[worker]
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(pool, functools.partial(_call, op, *args))
        except BrokenProcessPool as err:
            self._replace(worker, pool)
            raise EpisodesLost(f"episode worker {worker} died ({err}); the episodes it held are lost") from err

    def _replace(self, worker: int, pool: ProcessPoolExecutor) -> None:
        """A fresh worker for a dead one (the first caller that finds it dead replaces it); the
        episodes it held are forgotten."""
        if self.pools[worker] is not pool:
            return
        self.pools[worker] = self._new_pool()
        self.restarts += 1
        lost = [key for key, w in self.home.items() if w == worker]
        self._forget(lost)
        pool.shutdown(wait=False, cancel_futures=True)
        log.error("episode worker %d died: its %d episode(s) are lost and their groups start again; a new worker "
                  "replaces it (%d replaced so far)", worker, len(lost), self.restarts)

    async def open(self, env: str, problem: Problem, n: int) -> tuple[list[str], Start]:
        tie = next(self._tie)
        worker = min(range(len(self.pools)), key=lambda w: (self._load[w], (w - tie) % len(self.pools)))
        keys = [uuid.uuid4().hex for _ in range(n)]
        for key in keys:
            self.home[key] = worker
        self._load[worker] += n
        try:
            return keys, await self._run(worker, "open", env, problem, keys)
        except BaseException:
            self._forget(keys)
            raise

    def _forget(self, keys) -> None:
        for key in keys:
            worker = self.home.pop(key, None)
            if worker is not None:
                self._load[worker] -= 1

    def _by_worker(self, keys) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            out.setdefault(self.home[key], []).append(i)
        return out

    async def step(self, items: list[tuple[str, str]]) -> list[Answer]:
        groups = self._by_worker([k for k, _ in items])
        parts = await asyncio.gather(*(self._run(w, "step", [items[i] for i in idx]) for w, idx in groups.items()))
        out: list[Optional[Answer]] = [None] * len(items)
        for idx, answers in zip(groups.values(), parts):
            for i, answer in zip(idx, answers):
                out[i] = answer
        self._forget([key for (key, _), a in zip(items, out) if a.reply.done])
        return out

    async def close(self, keys: list[str]) -> list[VerifierResult]:
        groups = self._by_worker(keys)
        parts = await asyncio.gather(*(self._run(w, "close", [keys[i] for i in idx]) for w, idx in groups.items()))
        out: list[Optional[VerifierResult]] = [None] * len(keys)
        for idx, results in zip(groups.values(), parts):
            for i, result in zip(idx, results):
                out[i] = result
        self._forget(keys)
        return out

    def discard(self, keys: list[str]) -> None:
        """Drop episodes nobody will finish (a cancelled group), without waiting."""
        keys = [k for k in keys if k in self.home]
        for w, idx in self._by_worker(keys).items():
            pool = self.pools[w]
            try:
                pool.submit(functools.partial(_call, "discard", [keys[i] for i in idx]))
            except BrokenProcessPool:  # it died: its episodes are gone anyway
                self._replace(w, pool)
        self._forget(keys)

    def live(self) -> int:
        return len(self.home)

    def shutdown(self) -> None:
        for pool in self.pools:
            pool.shutdown(wait=True, cancel_futures=True)
