"""Trainer side: push this step's weights to every vLLM server without draining generation.

Call on every trainer rank (never imports vLLM)::

    sender = WeightSender(WeightSyncConfig(), members=members, model=model, ctx=ctx, vocab_size=vocab_size,
                          to_hf=to_hf)
    report = sender.push(version=step)    # after each optimizer step (or every k steps)

``members`` is the fleet: a list of server URLs, or a function returning ``(url, instance)``
pairs (the run directory's registrations, ``fleet/registry.py``). Before each push the coordinator
checks the fleet: on the first push, when a server joined, left or restarted (a new instance, or
a version other than the last one pushed), every rank drops its groups and the whole fleet joins
new ones (``connect``), so a restarted or late server gets the current weights with the next
push. Until then it serves its start-up weights, under their own version label; the actor's
client does not send it requests (``fleet/client.py``, version gate).

Roles (``source.source_role``): each pipeline stage's sender is its (tp_rank 0, dp_rank 0) rank;
the other TP ranks of that replica only take part in the TP gathers; with a mixture of experts,
each expert-parallel rank of expert-DP replica 0 also sends its own experts on a group of its own
(a stage then has ``ep`` sources). Other ranks do nothing but wait for the report. Global rank 0
(stage 0's first source) is also the coordinator that drives the HTTP routes.

One update, as seen by a server: ``/start_weight_update`` (its receiving threads start; decoding
goes on) -> every stage broadcasts its plan, its buckets and their checksum table on its own
group, gathering and converting the next tensors while earlier buckets are on the wire (async
broadcasts; large tensors straight from their own memory, small ones packed) ->
``/pause?mode=keep`` -> ``/update_weights`` (verify everything, then load) ->
``/finish_weight_update`` (new version label) -> ``/resume``. Requests in flight continue under the
new weights, and their outputs carry both version labels; their KV cache is computed again with
the new weights (``fleet.kv_on_update=recompute``, vLLM's pause clears it) or kept (``keep``).

Deadlock freedom with PP > 1: stage groups are independent and the receiver drains them
concurrently, so a stage's broadcast never waits for another stage. Between ``push``'s start and
the final report broadcast, a rank runs only its own stage's TP gathers and broadcast; the only
cross-stage collective (the report) comes after every stage finished sending.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable, Optional, Sequence, Union

import httpx
import torch
import torch.distributed as dist

from megatron_apriel.parallel.collectives import any_rank
from megatron_apriel.parallel.groups import ParallelContext
from megatron_apriel.records.weights import FleetWindow, StagePlan, SyncReport, TransferInit, UpdateRequest
from megatron_apriel.stop import StopRequested
from megatron_apriel.weight_sync import buckets as B
from megatron_apriel.weight_sync.config import WeightSyncConfig
from megatron_apriel.weight_sync.control import Probe, ServerError, WeightSyncControl, probe_versions
from megatron_apriel.weight_sync.engine_counters import FleetReadings
from megatron_apriel.weight_sync.gather import StageWeights, ToHF
from megatron_apriel.weight_sync.transport import StageGroup, host_stage_store, join_stage_group
from megatron_apriel.weight_sync.wire import BucketHook, DoubleBuffer, send_stage

log = logging.getLogger("megatron_apriel")

_STOP = "stop"
"""What the coordinator broadcasts instead of a fleet when a stop request ended its wait."""
Member = tuple[str, str]
"""A fleet member: (base URL, instance id; "" when unknown)."""
Members = Union[Sequence[str], Callable[[], list[Member]]]


BUSY_GRACE_S = 30.0
"""How long a connected server may stay too busy to answer before it is left out (a stopped
process accepts connections and never answers: the push must not wait on it)."""


def live_members(members: list[Member], probes: dict[str, Probe], connected: list[Member],
                 busy_s: dict[str, float]) -> list[Member]:
    """The members to keep (or join): those that answered, and those already connected that have
    been too busy to answer for less than ``BUSY_GRACE_S`` (``busy_s``: since when, per URL). A
    loaded server at start-up misses a 5 s probe now and then: leaving it out and joining it again
    a moment later made the fleet flap. A busy member not connected yet joins once it answers."""
    joined = set(connected)
    return [m for m in members if probes[m[0]].version is not None
            or (probes[m[0]].busy and m in joined and busy_s.get(m[0], 0.0) < BUSY_GRACE_S)]


class WeightSender:
    def __init__(self, cfg: WeightSyncConfig, *, members: Members, model, ctx: ParallelContext, vocab_size: int,
                 to_hf: ToHF, on_bucket: Optional[BucketHook] = None,
                 should_stop: Callable[[], bool] = lambda: False, keep_kv: bool = False):
        """``should_stop``: the coordinator's stop request; a wait for the fleet ends with
        `StopRequested` on every rank when it is set (the fleet is probably stopping too).
        ``keep_kv`` (``fleet.kv_on_update=keep``): the servers' running requests keep their KV cache
        across the update; else vLLM computes their prefixes again with the new weights."""
        self.cfg, self.ctx, self.keep_kv = cfg, ctx, keep_kv
        self.should_stop = should_stop
        self.members = members if callable(members) else (lambda urls=tuple(members): [(u, "") for u in urls])
        self.backend = cfg.backend if cfg.backend != "auto" else ("nccl" if ctx.device.type == "cuda" else "gloo")
        self.device = ctx.device if self.backend == "nccl" else torch.device("cpu")
        if self.backend == "nccl" and cfg.checksum != "sum64":
            raise ValueError(f"weight_sync.checksum={cfg.checksum} reads host memory; NCCL buckets stay on the GPU: "
                             "use weight_sync.checksum=sum64 (computed on the device).")
        self.algo = cfg.checksum
        self.weights = StageWeights(model, ctx, vocab_size, to_hf)
        self.role = self.weights.role
        self.is_coordinator = ctx.rank == 0
        self.on_bucket = on_bucket
        self.group: Optional[StageGroup] = None
        self.control: Optional[WeightSyncControl] = None
        self.connected: Optional[list[Member]] = None
        self._busy_since: dict[str, float] = {}
        """Servers that took the last probes' connections without answering in time, since when."""
        self.last_version: Optional[int] = None
        self.reconnects = 0
        self._readings = FleetReadings()
        self._last_check = 0.0
        """Times the fleet was joined again after the first connection (a server restarted, joined or left)."""
        self._buffers = DoubleBuffer(self.device)
        self._layouts: Optional[list] = None
        """The stage's bucket plan: fixed by the model's structure, so made once."""

    def _live_members(self) -> Optional[tuple[list[Member], dict[str, Optional[int]]]]:
        """The fleet's members that answer, with their versions; waits (up to timeout_s) for one.
        None if a stop is requested while no server answers."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            members = sorted(self.members())
            probes = probe_versions([url for url, _ in members])
            now = time.monotonic()
            self._busy_since = {url: self._busy_since.get(url, now) for url, probe in probes.items() if probe.busy}
            live = live_members(members, probes, self.connected or [],
                                {url: now - since for url, since in self._busy_since.items()})
            if live:
                return live, {url: probe.version for url, probe in probes.items()}
            if self.should_stop():
                return None
            if time.monotonic() > deadline:
                raise RuntimeError(f"no vLLM server of {[u for u, _ in members] or 'the fleet'} answered for "
                                   f"{self.cfg.timeout_s}s: list them in fleet.servers or start them with "
                                   "--register-dir run_dir/fleet, and check their logs.")
            time.sleep(1.0)

    def _fleet_changed(self) -> Union[None, str, list[Member]]:
        """Coordinator: the fleet to (re)connect to, or None if the connected one is intact, or
        ``_STOP``. A server that does not answer is left out until it is back (registered again)."""
        found = self._live_members()
        if found is None:
            return _STOP
        live, versions = found
        if live != self.connected:
            if self.connected is not None:
                log.warning("fleet changed: %s -> %s; reconnecting", self.connected, live)
            return live
        stale = {url: versions[url] for url, _ in live if versions[url] not in (None, self.last_version)}
        if stale and self.last_version is not None:
            log.warning("servers %s serve versions %s, not %s (restarted?): reconnecting the fleet", sorted(stale),
                        sorted(stale.values()), self.last_version)
            return live
        return None

    def ensure_connected(self, force: bool = False) -> bool:
        """(Re)join the stage groups if the fleet changed, or ``force`` (every rank calls); True if it did.
        Raises `StopRequested` on every rank if a stop ended the coordinator's wait for a server."""
        change = [None]
        if self.is_coordinator and force:
            found = self._live_members()
            change = [_STOP if found is None else found[0]]
        elif self.is_coordinator:
            change = [self._fleet_changed()]
        dist.broadcast_object_list(change, src=0)
        if change[0] == _STOP:
            raise StopRequested
        if change[0] is None:
            return False
        self._reconnect(change[0])
        return True

    def refresh(self, every_s: float = 2.0) -> Optional[SyncReport]:
        """Between pushes (every rank calls; the trainer does while it waits for rollouts): if the
        fleet changed since the last push, reconnect and send the weights of the last push again,
        under its version, so a restarted server can serve before the next step ends. The fleet
        is checked at most every ``every_s`` seconds; returns the push's report, or None."""
        due = [self.is_coordinator and time.monotonic() - self._last_check >= every_s]
        dist.broadcast_object_list(due, src=0)
        if not due[0] or self.last_version is None:
            return None
        self._last_check = time.monotonic()
        if not self.ensure_connected():
            return None
        return self.push(self.last_version, check_fleet=False)

    def _reconnect(self, members: list[Member]) -> None:
        self.close()
        if self.is_coordinator:
            self.control = WeightSyncControl([url for url, _ in members], self.cfg.timeout_s, keep_kv=self.keep_kv)
        self.connect()
        self.reconnects += self.last_version is not None  # the first connection is not a reconnection
        self.connected = members

    def connect(self) -> None:
        """Join the source groups (every rank calls; only sources join a group)."""
        sizes = [self.control.workers_per_server() if self.is_coordinator else None]
        dist.broadcast_object_list(sizes, src=0)
        world = 1 + sum(sizes[0])
        store, mine = None, None
        if self.role.sends:
            store, endpoint = host_stage_store(self.cfg.advertise_host or socket.gethostname(),
                                               self.cfg.stage_port(self.role.source), world, self.cfg.timeout_s)
            mine = (self.role.source, endpoint)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        endpoints = dict(e for e in everyone if e is not None)
        stages = [endpoints[s] for s in range(self.role.num_sources)]
        if self.is_coordinator:
            log.info("weight sync: the servers join %s", ", ".join(f"{e.host}:{e.port}" for e in stages))
        pending = []
        if self.is_coordinator:
            offsets = [1 + sum(sizes[0][:i]) for i in range(len(sizes[0]))]
            pending = self.control.init_async([
                TransferInit(backend=self.backend, stages=stages, world_size=world, rank_offset=o,
                             timeout_s=self.cfg.timeout_s) for o in offsets])
        if self.role.sends:
            self.group = join_stage_group(stages[self.role.source], 0, world, self.backend, self.cfg.timeout_s,
                                          self.device, store=store)
        for f in pending:
            f.result()
        dist.barrier()

    def _send_stage(self, version: int) -> tuple[int, int, Optional[str]]:
        if self._layouts is None:
            self._layouts = B.plan_buckets(self.weights.metadata(), self.cfg.bucket_bytes, self.cfg.direct_bytes)
        layouts = self._layouts
        plan = StagePlan(version=version, stage=self.role.source, num_stages=self.role.num_sources,
                         checksum=self.algo, buckets=layouts)
        failure = send_stage(self.group, plan, self.weights.hf_tensors(self.device), self._buffers, self.on_bucket)
        return plan.nbytes, len(layouts), failure

    def push(self, version: int, check_fleet: bool = True) -> SyncReport:
        """Send this step's weights as ``version``; returns the (coordinator's) report on every rank.
        An update that a server's death breaks is sent again to the fleet as it is then."""
        for attempt in range(1, self.cfg.push_attempts + 1):
            if check_fleet or attempt > 1:
                self.ensure_connected(force=attempt > 1)
            report = self._push_once(version)
            if report is not None:
                self.last_version = version
                return report
            if any_rank(self.should_stop()):  # servers stopping with the trainer: no point sending again
                log.warning("weight update %d failed while a stop is requested: not sending it again", version)
                raise StopRequested
            log.warning("weight update %d failed (attempt %d of %d; a server left mid-update?): joining the fleet "
                        "again", version, attempt, self.cfg.push_attempts)
            if self.is_coordinator:
                gone = self.control.abort()  # the servers that answer close the update they had open
                log.warning("servers not answering: %s", gone or "none")
        raise RuntimeError(f"weight update {version} failed {self.cfg.push_attempts} times (weight_sync.push_attempts):"
                           " see the warnings above and the vLLM servers' logs.")

    def _push_once(self, version: int) -> Optional[SyncReport]:
        """One try, on every rank; None if it failed on any. A failure after ``/update_weights``
        may leave survivors on the new weights under the old version label until the retry: their
        tokens then look older than they are, never newer (the lag bound stays safe)."""
        t0 = time.perf_counter()
        self._last_check = time.monotonic()
        failure = self._control("start", lambda: self.control.start()) if self.is_coordinator else None
        if any_rank(failure is not None):
            return None
        nbytes = nbuckets = 0
        if self.role.sends:
            nbytes, nbuckets, failure = self._send_stage(version)
            if failure is not None:
                log.warning("source %d's weight-sync group failed mid-update: %s", self.role.source, failure)
        elif self.role.gather_dense:
            self.weights.gather_only()
        send_s = time.perf_counter() - t0
        if any_rank(failure is not None):
            return None
        report = [self._finish(version, t0, send_s, nbytes, nbuckets) if self.is_coordinator else None]
        dist.broadcast_object_list(report, src=0)
        return report[0]

    def _control(self, what: str, call: Callable[[], object]) -> Optional[str]:
        """Coordinator: an HTTP control call; a server that does not answer is returned as the failure."""
        try:
            call()
        except (ServerError, httpx.TransportError) as err:
            log.warning("/%s failed: %s", what, err)
            return f"{type(err).__name__}: {err}"
        return None

    def _finish(self, version: int, t0: float, send_s: float, nbytes: int,
                nbuckets: int) -> Optional[SyncReport]:
        """Coordinator: pause, verify and load on every server, finish, resume. None if a server
        stopped answering (the survivors are resumed; the caller sends the update again)."""
        control = self.control
        paused = time.perf_counter()
        rejected: dict[str, str] = {}
        window: list[Optional[FleetWindow]] = []

        def apply() -> None:
            control.pause()
            try:
                counters = control.request_counters()  # asked now, collected once the weights loaded
                rejected.update(control.update(UpdateRequest(version=version, num_stages=self.role.num_sources)))
                control.finish([s for s in control.servers if s not in rejected], version)
                window.append(self._readings.window(control.collect_counters(counters), time.monotonic()))
            finally:
                control.resume()  # every server is asked, even if one does not answer

        if self._control("update_weights", apply) is not None:
            return None
        pause_s = time.perf_counter() - paused
        return SyncReport(version=version, accepted=not rejected, servers=control.servers, rejected=rejected,
                          nbytes=nbytes, num_buckets=nbuckets, send_s=send_s, pause_s=pause_s,
                          total_s=time.perf_counter() - t0, fleet=window[0])

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None  # drops its TCPStore, so the stage's port can be bound again
        if self.control is not None:
            self.control.close()
            self.control = None
