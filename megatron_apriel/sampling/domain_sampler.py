"""Adaptive multi-domain sampler (RECIPE.md section 3).

The actor asks `sample()` which domain its next group of rollouts comes from, and calls
`record_completion(domain, n, trained=...)` once per *finished group* (a group of G adds G), saying
whether the group will be trained (neither dropped for zero advantage nor for a verifier error).
Domains whose rollouts fall behind their target share get their probability raised:

    t_d = w_d / sum_j w_j                                  (target share)
    N < min_completions:  p_d = t_d                        (static sampling)
    otherwise:            a_d = clip(t_d / (n_d / N), lo, hi), with a_d = hi when n_d = 0
                          p_d = w_d a_d / sum_j w_j a_j

Which rollouts n_d (and N = sum_d n_d) counts is ``count``:
- ``completed`` (the recipe's rule, the default): every finished rollout, including those of
  groups that dynamic sampling then drops. The *completed* mix is held at the target; the trained
  mix is not, where domains' groups are dropped at different rates (``benchmarks/recipe_mechanisms.py``
  measured code at 37-41 % of trained rollouts against a 31 % target).
- ``trained``: only the rollouts of groups that will be trained (the warm-up counts these). The
  *trained* mix is held at the target instead: with k_d = trained_d / completed_d (the share of d's
  rollouts kept so far), the formula above runs on the completed counts towards the completed mix
  c_d = (t_d / k_d) / sum_j (t_j / k_j), whose kept rollouts make the target mix; domains whose groups
  are often dropped are sampled more. (The formula applied to the trained counts directly settles
  at trained shares ~ t_d sqrt(k_d), not t_d: 4.7 pp off in the mechanisms benchmark.)
The sampler keeps both counts whichever steers it, and both are in `state_dict()` (the stream's
snapshots), so either mix of any run can be read back.

Counts are cumulative, never windowed. The RNG state is part of `state_dict()`, so a sampler
restored with `load_state_dict()` makes exactly the choices the saved one would have made.

How a domain is drawn from p (``draws``): ``iid`` takes an independent uniform u per draw, as the
authors' code does. ``low_discrepancy`` (the default) takes u_k = frac(u_0 + k / golden ratio)
from a random start u_0: every u_k is still uniform, so each draw picks domain d with probability
p_d, but consecutive draws cover [0, 1) evenly, which removes most of the random-walk noise of
i.i.d. draws. With 2,000 rollouts (250 groups of 8), 10x latency skew and 16 groups in flight,
the largest gap to the target mix over 10 seeds is 0.25-0.7 pp with it and 0.35-2.4 pp with
i.i.d. draws (``benchmarks/domain_mix.py``).

Usage::

    sampler = AdaptiveDomainSampler(DOMAIN_MIX_PAPER, seed=cfg.seed)
    domain = sampler.sample()              # pick a domain, then a problem from its pool
    ...                                    # once the group of G is finished and scored:
    sampler.record_completion(domain, G, trained=group.dropped is None)
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional

DOMAIN_MIX_PAPER: Mapping[str, float] = MappingProxyType(
    {"math": 0.40, "code": 0.25, "logic": 0.15, "ifeval": 0.10, "function_calling": 0.10})
"""The paper's mix (RECIPE.md section 1, from the paper summaries); the default."""

DOMAIN_MIX_PIPELINERL: Mapping[str, float] = MappingProxyType(
    {"math": 0.35, "code": 0.25, "logic": 0.15, "ifeval": 0.15, "function_calling": 0.10})
"""The authors' repository default (`conf/domain_mix/base.yaml`)."""

DOMAIN_MIX_PRESETS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {"paper": DOMAIN_MIX_PAPER, "pipelinerl": DOMAIN_MIX_PIPELINERL})

_STATE_VERSION = 3
"""Version 3 added the trained counts (``trained``) and the count that steered (``count``);
version 2 states are read through `state_from_v2` with the trained counts recounted."""
DRAWS = ("low_discrepancy", "iid")
COUNTS = ("completed", "trained")
_INV_GOLDEN = 0.6180339887498949  # 1 / golden ratio: the most evenly spreading additive step


@dataclass(kw_only=True)
class SamplerConfig:
    """Configuration of `AdaptiveDomainSampler`; composed into the run config by Hydra."""

    weights: Optional[dict[str, float]] = None
    """Unnormalised domain weights w_d; the target share of domain d is w_d / sum(w). Null: the
    paper's mix (DOMAIN_MIX_PAPER), which every config composed by ``config.py`` writes out. A
    preset, or a dict on the command line, gives the whole mix: domains it leaves out are not
    sampled (null, not a default dict, so that Hydra does not merge a preset's mix into it; the
    command line's forms are in ``config.py``)."""

    min_completions: int = 50
    """Static sampling (p_d = t_d) until this many rollouts have completed in total."""

    clip_low: float = 0.1
    """Lower bound on the correction factor a_d."""

    clip_high: float = 10.0
    """Upper bound on a_d; also the factor of a domain with no completions yet."""

    seed: int = 0
    """Seed of the sampler's private RNG."""

    draws: str = "low_discrepancy"
    """How u ~ U[0, 1) is drawn for each choice: low_discrepancy (golden-ratio sequence, random start)
    or iid (the authors' code). Both pick domain d with probability p_d; see the module docstring."""

    count: str = "completed"
    """Which rollouts the correction counts: completed (every finished rollout, the recipe's rule)
    or trained (only those of groups that will be trained: not dropped for zero advantage or a
    verifier error). Both counts are kept and saved either way; see the module docstring."""

    def __post_init__(self) -> None:
        _validate_weights(self.mix)
        if self.min_completions < 0:
            raise ValueError(f"min_completions={self.min_completions}: must be >= 0 (50 in the recipe).")
        if not 0.0 < self.clip_low <= 1.0 <= self.clip_high:
            raise ValueError(f"clip=({self.clip_low}, {self.clip_high}): need 0 < clip_low <= 1 <= clip_high "
                             "(the recipe uses 0.1 and 10).")
        if self.draws not in DRAWS:
            raise ValueError(f"draws={self.draws!r}: use one of {DRAWS}.")
        if self.count not in COUNTS:
            raise ValueError(f"actor.sampler.count={self.count!r}: use one of {COUNTS} (completed is the recipe's).")

    @property
    def mix(self) -> dict[str, float]:
        return dict(DOMAIN_MIX_PAPER if self.weights is None else self.weights)

    def build(self) -> AdaptiveDomainSampler:
        return AdaptiveDomainSampler(self.mix, min_completions=self.min_completions,
                                     clip=(self.clip_low, self.clip_high), seed=self.seed, draws=self.draws,
                                     count=self.count)


def _validate_weights(weights: Mapping[str, float]) -> None:
    if not weights:
        raise ValueError("weights is empty: give at least one domain, e.g. DOMAIN_MIX_PAPER.")
    for domain, w in weights.items():
        if not isinstance(domain, str) or not domain:
            raise ValueError(f"domain name {domain!r} must be a non-empty string.")
        if not (isinstance(w, (int, float)) and w > 0 and w != float("inf")):
            raise ValueError(f"actor.sampler.weights.{domain}={w!r}: weights must be finite and > 0; drop the domain "
                             f"from the mix (~actor.sampler.weights.{domain}) instead of giving it weight 0.")


class AdaptiveDomainSampler:
    """Thread-safe adaptive domain sampler; see the module docstring for the formula."""

    def __init__(self, weights: Mapping[str, float], min_completions: int = 50,
                 clip: tuple[float, float] = (0.1, 10.0), seed: int = 0, draws: str = "low_discrepancy",
                 count: str = "completed") -> None:
        SamplerConfig(weights=dict(weights), min_completions=min_completions, clip_low=clip[0], clip_high=clip[1],
                      seed=seed, draws=draws, count=count)  # validates
        self._domains = tuple(weights)
        self._weights = {d: float(weights[d]) for d in self._domains}
        total = sum(self._weights.values())
        self._targets = {d: w / total for d, w in self._weights.items()}
        self._min_completions = min_completions
        self._clip = (float(clip[0]), float(clip[1]))
        self._counts = {d: 0 for d in self._domains}
        """Completed rollouts per domain."""
        self._trained = {d: 0 for d in self._domains}
        """Rollouts per domain of the groups that will be trained."""
        self._count = count
        self._rng = random.Random(seed)
        self._draws = draws
        self._u = self._rng.random()  # start of the low-discrepancy sequence
        self._lock = threading.Lock()

    @property
    def domains(self) -> tuple[str, ...]:
        return self._domains

    @property
    def count(self) -> str:
        """Which counts steer the probabilities: ``completed`` or ``trained``."""
        return self._count

    @property
    def targets(self) -> dict[str, float]:
        """Target shares t_d (sum to 1)."""
        return dict(self._targets)

    def counts(self, kind: str = "completed") -> dict[str, int]:
        """Rollouts per domain so far: ``completed`` ones, or those of groups to be ``trained``."""
        if kind not in COUNTS:
            raise ValueError(f"kind={kind!r}: use one of {COUNTS}.")
        with self._lock:
            return dict(self._counts if kind == "completed" else self._trained)

    def probabilities(self) -> dict[str, float]:
        """Current sampling distribution p_d over the domains (sums to 1)."""
        with self._lock:
            return self._probabilities_locked()

    def _probabilities_locked(self) -> dict[str, float]:
        counted = self._counts if self._count == "completed" else self._trained
        if sum(counted.values()) < self._min_completions:
            return dict(self._targets)
        # the completed mix to hold: the targets, or with count=trained the mix whose kept groups
        # make the target trained mix (t_d / k_d, k_d = domain d's share of rollouts kept)
        goal, base = (self._targets, self._weights) if self._count == "completed" else (self._kept_goal(),) * 2
        total = sum(self._counts.values())
        low, high = self._clip
        scores = {}
        for d in self._domains:
            n = self._counts[d]
            alpha = high if n == 0 else min(max(goal[d] / (n / total), low), high)
            scores[d] = base[d] * alpha
        norm = sum(scores.values())
        return {d: s / norm for d, s in scores.items()}

    def _kept_goal(self) -> dict[str, float]:
        """The completed shares c_d ~ t_d / k_d whose trained shares c_d k_d / sum_j c_j k_j are the
        targets, with k_d = trained_d / completed_d (1 while none of d's rollouts is kept: no evidence;
        1 / k_d at most clip_high)."""
        raw = {}
        for d in self._domains:
            kept = self._trained[d] / self._counts[d] if self._trained[d] else 1.0
            raw[d] = self._targets[d] * min(1.0 / kept, self._clip[1])
        norm = sum(raw.values())
        return {d: r / norm for d, r in raw.items()}

    def sample(self) -> str:
        """Draw the domain of the next group from `probabilities()`, advancing the RNG once."""
        with self._lock:
            probs = self._probabilities_locked()
            u = self._next_uniform_locked()
            cumulative = 0.0
            for d in self._domains:
                cumulative += probs[d]
                if u < cumulative:
                    return d
            return self._domains[-1]  # u within rounding error of 1

    def _next_uniform_locked(self) -> float:
        if self._draws == "iid":
            return self._rng.random()
        self._u = (self._u + _INV_GOLDEN) % 1.0
        return self._u

    def record_completion(self, domain: str, n: int = 1, *, trained: bool = True) -> None:
        """Count `n` finished rollouts of `domain` (call once per rollout, or once per group with
        n=G); ``trained``: whether they will be trained (False for a dropped group's)."""
        if domain not in self._counts:
            raise ValueError(f"unknown domain {domain!r}; this sampler has {list(self._domains)}. "
                             "Add the domain to the sampler's weights.")
        if n < 1:
            raise ValueError(f"n={n}: record at least one completion.")
        with self._lock:
            self._counts[domain] += n
            if trained:
                self._trained[domain] += n

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: both counts (``counts``: completed, ``trained``), the count
        that steers (``count``) and the RNG state."""
        with self._lock:
            version, internal, gauss = self._rng.getstate()
            return {"version": _STATE_VERSION, "count": self._count, "counts": dict(self._counts),
                    "trained": dict(self._trained), "rng": [version, list(internal), gauss], "draws": self._draws,
                    "u": self._u}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore both counts and the RNG. The domains and draws must match; the weights and the
        count that steers stay those of this sampler (both counts are saved, so a run may resume
        with the other ``count``: it then steers by the other mix from here on)."""
        if state.get("version") != _STATE_VERSION:
            old = " (version 2: convert it with state_from_v2)" if state.get("version") == 2 else ""
            raise ValueError(f"sampler state version {state.get('version')!r} != {_STATE_VERSION}{old}; "
                             "it was written by an incompatible release.")
        counts, trained = _checked_counts(state["counts"], self._domains), _checked_counts(state["trained"],
                                                                                           self._domains)
        if any(trained[d] > counts[d] for d in self._domains):
            raise ValueError(f"saved trained counts {trained} exceed the completed counts {counts}: the state is "
                             "damaged.")
        if state["draws"] != self._draws:
            raise ValueError(f"saved draws={state['draws']!r} differ from this sampler's {self._draws!r}; "
                             "resume with the same sampler configuration.")
        version, internal, gauss = state["rng"]
        with self._lock:
            self._u = float(state["u"])
            self._counts = {d: counts[d] for d in self._domains}
            self._trained = {d: trained[d] for d in self._domains}
            self._rng.setstate((version, tuple(internal), gauss))


def _checked_counts(saved: Mapping[str, Any], domains: tuple[str, ...]) -> dict[str, int]:
    counts = dict(saved)
    if set(counts) != set(domains):
        raise ValueError(f"saved domains {sorted(counts)} differ from this sampler's "
                         f"{sorted(domains)}; resume with the same domain set.")
    if any(not isinstance(c, int) or c < 0 for c in counts.values()):
        raise ValueError(f"saved counts {counts} must be non-negative integers.")
    return counts


def state_from_v2(state: Mapping[str, Any], trained: Mapping[str, int]) -> dict[str, Any]:
    """A version-2 state (written before the trained counts existed; it steered by the completed
    counts) as version 3, with ``trained``: the rollouts per domain of the groups not dropped,
    recounted from the stream that state heads (the actor does this on resume)."""
    if state.get("version") != 2:
        raise ValueError(f"state_from_v2 converts version 2 states, not version {state.get('version')!r}.")
    domains = {d: 0 for d in state["counts"]}
    return {**state, "version": _STATE_VERSION, "count": "completed", "trained": {**domains, **trained}}
