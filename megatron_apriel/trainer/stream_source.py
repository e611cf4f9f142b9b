"""Where the trainer's rollouts come from: the `RolloutSource` protocol and the stream source.

    source = StreamSource(RunDir(run_dir).rollouts, cfg.rollout, ctx, domain_targets)
    samples, metrics = source.next_batch(step, idle)   # every rank: this DP rank's samples
    ...                                            # train, push weights as version step + 1
    source.weights_updated(step + 1)

`StreamSource` reads the durable stream (written by the actor) on the first rank: it takes groups
in sequence order, skips those the actor dropped (zero advantage, verifier error) and those
older than ``max_lag``, until it holds ``groups_per_step`` usable groups; it publishes its
progress for the actor's admission control while it waits. All ranks poll together (a small
broadcast per poll), so that the trainer can act on every rank while it waits (``idle``: bring a
restarted server up to date). Once the step is full rank 0 sends every rank the plan
(which rollouts each DP rank trains, balanced by tokens, and the step's rollout metrics), and
each rank loads its own rollouts from the segment files. The cursor is the source's state: it
is saved in the trainer's checkpoints, so a resumed run reads exactly the groups that follow.

The domain mix, per step and over the run so far: ``mix/<d>/realised`` is domain d's share of the
groups read (every completed group, dropped and stale ones included: the mix the sampler holds
with ``actor.sampler.count=completed``), ``mix/<d>/trained`` its share of the groups trained (with
``count=trained`` the sampler holds this one), ``mix/<d>/target`` its target share.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

from megatron_apriel.parallel.collectives import broadcast_object
from megatron_apriel.records.config import RolloutConfig
from megatron_apriel.records.lag import group_lag
from megatron_apriel.records.rollouts import RolloutGroup
from megatron_apriel.records.samples import TrainSample, balance_by_tokens
from megatron_apriel.records.stream import StreamReader, TrainerProgress, read_segment, segment_path, write_progress
from megatron_apriel.trainer.mismatch import server_key
from megatron_apriel.trainer.update_cost import recomputed_tokens, stale_cache_tokens


class RolloutSource(Protocol):
    def next_batch(self, step: int, idle: Optional[Callable[[], None]] = None) -> tuple[list[TrainSample], dict]:
        """This DP rank's samples for ``step`` and the step's rollout metrics (same on every rank);
        ``idle()`` is called on every rank together while the step waits for rollouts."""

    def weights_updated(self, version: int) -> None:
        """The fleet has been sent the weights of ``version`` (called on every rank)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class _Filling:
    """What rank 0 has read so far for one step."""

    step: int
    taken: list = field(default_factory=list)  # (segment first seq, group) of the usable groups
    read: list = field(default_factory=list)  # every group read, dropped and stale ones included
    skipped: Counter = field(default_factory=Counter)
    lags: list = field(default_factory=list)


@dataclass
class StepPlan:
    """What rank 0 tells every rank about one step (small: no token data)."""

    cursor: int
    rollouts: list[list[tuple[int, int, int]]]
    """Per DP rank: (segment first seq, group seq, rollout index) of each sample it trains."""
    metrics: dict[str, float]
    domains: dict[str, int]
    """Trained groups per domain in this step."""
    read: dict[str, int] = field(default_factory=dict)
    """Groups read per domain in this step (dropped and stale ones included)."""


class StreamSource:
    def __init__(self, root: str | Path, cfg: RolloutConfig, ctx, targets: dict[str, float], poll_s: float = 0.05,
                 replay: bool = False, moe_layers: Optional[list[int]] = None):
        """``replay``: the stream is another run's, complete and read-only (no trainer.json is
        written, and a step it cannot fill is an error instead of a wait). ``moe_layers``: a MoE
        model's sparse layers: samples carry the routed experts recorded for them (required when
        ``cfg.routing_replay``)."""
        if cfg.groups_per_step * cfg.group_size < ctx.dims.dp:
            raise ValueError(f"rollout.groups_per_step x group_size = {cfg.groups_per_step * cfg.group_size} samples "
                             f"per step < dp={ctx.dims.dp}: every data-parallel rank needs at least one.")
        self.root, self.cfg, self.ctx = Path(root), cfg, ctx
        total = sum(targets.values())
        self.targets = {d: w / total for d, w in targets.items()}
        self.poll_s = poll_s
        self._filling: Optional[_Filling] = None
        self.reader = StreamReader(self.root)  # read on rank 0 only
        self.cursor = 0
        self.version = 0
        self.consumed: Counter = Counter()
        """Trained groups per domain, over the run (the trained mix)."""
        self.read: Counter = Counter()
        """Groups read per domain, over the run, dropped and stale ones included (the completed mix)."""
        self._last_read = time.monotonic()
        self._published: Optional[TrainerProgress] = None
        self._planned: dict[int, RolloutGroup] = {}
        """Rank 0: the groups of the step just planned, by seq (it has parsed them already)."""
        self.replay = replay
        self.moe_layers = moe_layers
        self.trips: list[tuple[str, int]] = []
        """Servers (host:port) the drift gate tripped, with the version it tripped at."""
        self.drop_tripped = False

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "version": self.version, "consumed": dict(self.consumed),
                "read": dict(self.read), "trips": [list(t) for t in self.trips], "drop_tripped": self.drop_tripped}

    def load_state_dict(self, state: dict) -> None:
        """The state of `state_dict`; one saved before the groups read were kept (no ``read``) has
        them recounted from the stream before its cursor, on the rank that reports the mix."""
        self.cursor = int(state["cursor"])
        self.reader = StreamReader(self.root, cursor=self.cursor)
        self.version = int(state["version"])
        self.consumed = Counter(state["consumed"])
        self.trips = [(server, int(version)) for server, version in state.get("trips", [])]
        self.drop_tripped = bool(state.get("drop_tripped", False))
        if "read" in state:
            self.read = Counter(state["read"])
        elif self.ctx.rank == 0:
            self.read = _groups_per_domain(self.root, self.cursor)

    def _publish(self, step: int, filled: int) -> None:
        progress = TrainerProgress(step=step, filled=filled, cursor=self.reader.cursor, version=self.version)
        if not self.replay and self.ctx.rank == 0 and progress != self._published:
            write_progress(self.root, progress)
            self._published = progress

    def server_tripped(self, server: str, version: int, drop: bool) -> None:
        """The drift gate tripped ``server`` (host:port) on the tokens of ``version``: its groups made
        before the trip (a rollout of it from ``version`` or older) are counted from now on
        (``rollout/groups_from_tripped``) and, with ``drop``, not trained."""
        self.trips.append((server, version))
        self.drop_tripped = drop

    def _from_tripped(self, group: RolloutGroup) -> bool:
        return any(server_key(r.server) == server and r.first_version <= version
                   for server, version in self.trips for r in group.rollouts)

    def weights_updated(self, version: int) -> None:
        self.version = version
        self._publish(step=version, filled=0)

    # -- one step ------------------------------------------------------------------------------
    def _poll(self, step: int) -> Optional[StepPlan]:
        """Rank 0: read what the stream holds now; the step's plan once it has enough usable groups."""
        st = self._filling if self._filling is not None and self._filling.step == step else _Filling(step)
        self._filling = st
        while len(st.taken) < self.cfg.groups_per_step and (group := self.reader.next_group()) is not None:
            st.read.append(group)
            lag = group_lag(step, group.min_version)
            if group.dropped:
                st.skipped["filtered" if group.dropped == "zero_advantage" else group.dropped] += 1
            elif self.cfg.max_lag is not None and lag > self.cfg.max_lag:
                st.skipped["stale"] += 1
            elif (tripped := self._from_tripped(group)) and self.drop_tripped:
                st.skipped["from_tripped"] += 1
            else:
                st.skipped["from_tripped"] += tripped
                st.lags.append(lag)
                st.taken.append((self.reader.segment_first, group))
        if len(st.taken) < self.cfg.groups_per_step:
            if self.replay:
                raise ValueError(f"the replayed stream {self.root} ran out at step {step} ({len(st.taken)} of "
                                 f"{self.cfg.groups_per_step} groups, {self.reader.cursor} read): lower "
                                 "trainer.steps, or check rollout.max_lag and groups_per_step against the "
                                 "recorded run.")
            self._publish(step, len(st.taken))  # the actor may admit what this step still needs
            return None
        self._filling = None
        self._publish(step + 1, 0)  # this step is full: the next group goes to the next step
        now = time.monotonic()
        metrics = self._metrics(st.read, [g for _, g in st.taken], st.skipped, st.lags, now - self._last_read)
        metrics["rollout/cursor"] = float(self.reader.cursor)  # the step read groups [previous cursor, this)
        self._last_read = now
        items = [(first, g.seq, i, len(g.prompt_ids) + r.length)
                 for first, g in st.taken for i, r in enumerate(g.rollouts)]
        parts = balance_by_tokens([n for *_, n in items], self.ctx.dims.dp)
        self._planned = {g.seq: g for _, g in st.taken}
        return StepPlan(cursor=self.reader.cursor, rollouts=[[items[i][:3] for i in part] for part in parts],
                        metrics=metrics, domains=dict(Counter(g.domain for _, g in st.taken)),
                        read=dict(Counter(g.domain for g in st.read)))

    def next_batch(self, step: int, idle: Optional[Callable[[], None]] = None) -> tuple[list[TrainSample], dict]:
        """Every rank polls together until the step is full; ``idle()`` runs on every rank between
        polls (it may issue collectives: the trainer uses it to bring a restarted server up to date,
        without which the actor could never finish the step)."""
        delay = self.poll_s
        while (plan := broadcast_object(self._poll(step) if self.ctx.rank == 0 else None)) is None:
            if idle is not None:
                idle()
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        self.cursor = plan.cursor
        samples = load_samples(self.root, plan.rollouts[self.ctx.dp_rank], step, self._planned, self.moe_layers,
                               self.cfg.routing_replay and self.moe_layers is not None)
        self._planned = {}
        self.consumed.update(plan.domains)
        self.read.update(plan.read)
        return samples, plan.metrics

    def _metrics(self, read: list[RolloutGroup], trained: list[RolloutGroup], skipped: Counter, lags: list[int],
                 wait_s: float) -> dict:
        """Rollout metrics over every group read this step (what the policy did, filtered groups
        included), and the lag and mix of the groups trained."""
        m: dict[str, float] = {f"rollout/groups_{k}": float(skipped[k])
                               for k in ("filtered", "verifier_error", "stale", "from_tripped")}
        m["rollout/groups_read"] = float(len(read))
        by_domain: dict[str, list] = defaultdict(list)
        for g in read:
            by_domain[g.domain] += g.rollouts
        everything = [r for g in read for r in g.rollouts]
        m.update(_rollout_stats("rollout", everything))
        for d, rs in by_domain.items():
            m.update(_rollout_stats(f"domain/{d}", rs))
        m["rollout/trained_reward"] = sum(r.reward for g in trained for r in g.rollouts) / sum(
            len(g.rollouts) for g in trained)
        m["rollout/lag_mean"] = sum(lags) / len(lags)
        m["rollout/lag_max"] = float(max(lags))
        for lag, n in sorted(Counter(lags).items()):
            m[f"lag/{lag}"] = n / len(lags)
        tokens = sum(r.length for r in everything)
        m["rollout/completion_tokens"] = float(tokens)
        m["rollout/consumed_tokens_per_s"] = tokens / max(wait_s, 1e-9)
        m["rollout/generate_s_mean"] = sum(g.timings.generate_s for g in read) / len(read)
        m["rollout/verify_s_mean"] = sum(g.timings.verify_s for g in read) / len(read)
        spanning = sum(len({s.version for s in r.versions}) > 1 for r in everything)
        m["rollout/multi_version_share"] = spanning / len(everything)
        m["rollout/recomputed_tokens"] = float(sum(recomputed_tokens(len(g.prompt_ids), r)
                                                   for g in read for r in g.rollouts))
        m["rollout/stale_cache_tokens"] = float(sum(stale_cache_tokens(r) for r in everything))
        m.update(self._mix(read, trained))
        return m

    def _mix(self, read: list[RolloutGroup], trained: list[RolloutGroup]) -> dict[str, float]:
        """Each domain's share of the groups read and of those trained, over the run up to this step."""
        read_by = self.read + Counter(g.domain for g in read)
        trained_by = self.consumed + Counter(g.domain for g in trained)
        read_total, trained_total = sum(read_by.values()), sum(trained_by.values())
        m = {}
        for d, t in self.targets.items():
            m[f"mix/{d}/realised"] = read_by[d] / read_total
            m[f"mix/{d}/trained"] = trained_by[d] / trained_total
            m[f"mix/{d}/target"] = t
        return m


def _groups_per_domain(root: Path, cursor: int) -> Counter:
    """Groups per domain in the stream at ``root`` before ``cursor``."""
    reader, counts = StreamReader(root), Counter()
    while reader.cursor < cursor and (group := reader.next_group()) is not None:
        counts[group.domain] += 1
    return counts


def _rollout_stats(prefix: str, rollouts) -> dict[str, float]:
    n = len(rollouts)
    return {f"{prefix}/reward": sum(r.reward for r in rollouts) / n,
            f"{prefix}/score": sum(r.score for r in rollouts) / n,
            f"{prefix}/success": sum(r.success for r in rollouts) / n,
            f"{prefix}/length": sum(r.length for r in rollouts) / n,
            f"{prefix}/truncated": sum(r.truncated for r in rollouts) / n,
            f"{prefix}/length_penalty": sum(r.reward - (0.0 if r.truncated else r.score) for r in rollouts) / n}


def load_samples(root: Path, items: list[tuple[int, int, int]], step: int,
                 known: Optional[dict[int, RolloutGroup]] = None, moe_layers: Optional[list[int]] = None,
                 need_routing: bool = False) -> list[TrainSample]:
    """The listed rollouts as samples: from ``known`` groups (by seq; rank 0 has read them), else
    from their segment files, each read once (routed experts as ``RolloutGroup.train_sample`` says)."""
    groups = dict(known or {})
    out = []
    for first, seq, index in items:
        if seq not in groups:
            groups.update({g.seq: g for g in read_segment(segment_path(root, first)).groups})
        out.append(groups[seq].train_sample(index, step, moe_layers, need_routing))
    return out
