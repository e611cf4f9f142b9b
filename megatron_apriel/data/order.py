"""The order in which each domain's problems are served: seeded, resumable, without repeats.

Each domain walks through its pool in a random permutation; when the pool is exhausted a new pass
starts with a new permutation. Permutation ``e`` of domain ``d`` is a pure function of
``(seed, d, e)``, so the whole state is two integers per domain (pass, position) and a resumed
actor serves exactly the problems an uninterrupted one would have. (The authors' code draws
uniformly with replacement; passes give the same marginal distribution with no problem served
twice before every other one of its domain was served once.)
"""

from __future__ import annotations

import random
from typing import Any, Mapping

from megatron_apriel.data.datasets import ProblemPools
from megatron_apriel.records.rollouts import Problem

_STATE_VERSION = 1


class DomainOrder:
    def __init__(self, pools: ProblemPools, seed: int):
        self.pools, self.seed = pools, seed
        self._by_id = {p.id: p for d in pools.domains for p in pools.problems(d)}
        self._pos: dict[str, list[int]] = {d: [0, 0] for d in pools.domains}  # domain -> [pass, index]
        self._perm: dict[str, tuple[int, list[int]]] = {}

    def _permutation(self, domain: str, epoch: int) -> list[int]:
        cached = self._perm.get(domain)
        if cached is None or cached[0] != epoch:
            order = list(range(self.pools.size(domain)))
            random.Random(f"{self.seed}:{domain}:{epoch}").shuffle(order)  # str seeds hash stably
            self._perm[domain] = cached = (epoch, order)
        return cached[1]

    def next(self, domain: str) -> Problem:
        if domain not in self._pos:
            raise ValueError(f"no problems for domain {domain!r}; loaded domains: {list(self._pos)}. "
                             "Add a data file for it (actor.data) or drop it from actor.sampler.weights.")
        epoch, index = self._pos[domain]
        problem = self.pools.problems(domain)[self._permutation(domain, epoch)[index]]
        index += 1
        self._pos[domain] = [epoch + 1, 0] if index == self.pools.size(domain) else [epoch, index]
        return problem

    def get(self, problem_id: str) -> Problem:
        """A problem by id (to regenerate a group that was in flight when the actor stopped)."""
        if problem_id not in self._by_id:
            raise ValueError(f"problem {problem_id!r} is not in the loaded data; resume with the same actor.data.")
        return self._by_id[problem_id]

    def state_dict(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "seed": self.seed, "sizes": {d: self.pools.size(d) for d in self._pos},
                "positions": {d: list(p) for d, p in self._pos.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"data order state version {state.get('version')!r} != {_STATE_VERSION}.")
        sizes = {d: self.pools.size(d) for d in self._pos}
        if state["seed"] != self.seed or state["sizes"] != sizes:
            raise ValueError(f"saved data order (seed {state['seed']}, pool sizes {state['sizes']}) does not match "
                             f"this run's (seed {self.seed}, {sizes}); resume with the same data and seed.")
        self._pos = {d: list(p) for d, p in state["positions"].items()}
