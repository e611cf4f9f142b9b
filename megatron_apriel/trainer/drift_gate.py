"""The drift gate (``fleet.drift_gate``): a server whose fresh-token drift is too large is taken
out of the fleet and restarted, as a crashed one is (docs/mismatch.md "The drift gate").

Each step the trainer measures every server's drift on the tokens it sampled with the weights being
trained (``mismatch/server/<host:port>/fresh_abs_log_rho``, pure train/inference mismatch: no policy
change in between) and, for a mixture of experts, its routing mismatch on them
(``.../routing_mismatch``). `DriftGate` adds a server's figures up until ``window_tokens`` fresh
tokens, then judges their means against ``max_drift`` (and ``max_routing_mismatch`` when set): a
server above either trips, one below both passes. A tripped
server counts as tripped until a later window of it passes; when every server seen has tripped, the
run stops. What happens to a trip (the log line, the server's retirement, its earlier groups) is the
trainer's; this class only judges.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_apriel.fleet.config import DriftGateConfig
from megatron_apriel.fleet.registry import registered, retire
from megatron_apriel.parallel.collectives import from_the_one_rank
from megatron_apriel.trainer.mismatch import server_key

log = logging.getLogger("megatron_apriel")

_PREFIX, _DRIFT, _TOKENS = "mismatch/server/", "/fresh_abs_log_rho", "/fresh_tokens"
_ROUTING, _COMPARED = "/routing_mismatch", "/routing_compared"


@dataclass(frozen=True)
class Trip:
    server: str
    """``host:port``, as in the metric keys."""
    version: int
    """The weight version its fresh tokens were sampled with (the step that measured them)."""
    drift: float
    """Mean |log pi_train - log pi_vllm| over the window, nats per token."""
    tokens: int
    routing: Optional[float] = None
    """The window's routing mismatch (share of compared (token, MoE layer) pairs); None: none compared."""
    pairs: int = 0

    def describe(self, cfg: DriftGateConfig) -> str:
        said = [f"drifted {self.drift:.4g} nats/token over {self.tokens} fresh tokens"
                + (f" > fleet.drift_gate.max_drift={cfg.max_drift}" if _above(self.drift, cfg.max_drift) else "")]
        if self.routing is not None and cfg.max_routing_mismatch is not None:
            said.append(f"routed {self.routing:.4g} of {self.pairs} (token, MoE layer) pairs to other experts than the "
                        "trainer" + (f" > fleet.drift_gate.max_routing_mismatch={cfg.max_routing_mismatch}"
                                     if _above(self.routing, cfg.max_routing_mismatch) else ""))
        return f"server {self.server} (weights version {self.version}) " + "; ".join(said)

    def trips(self, cfg: DriftGateConfig) -> bool:
        routing = self.routing is not None and cfg.max_routing_mismatch is not None
        return _above(self.drift, cfg.max_drift) or (routing and _above(self.routing, cfg.max_routing_mismatch))


def _above(figure: float, limit: float) -> bool:
    """``figure > limit``, and True for NaN: a server whose log-probs give no number (NaN, or -inf
    against -inf) is the one to take out, and ``nan > limit`` is False."""
    return not figure <= limit


def per_server(metrics: dict) -> dict[str, tuple[float, float, float, float]]:
    """``{host:port: (mean drift, fresh tokens, routing mismatch, compared pairs)}`` from a step's
    metrics (routing 0 of 0 pairs for a dense model)."""
    out = {}
    for key, value in metrics.items():
        if key.startswith(_PREFIX) and key.endswith(_DRIFT):
            server = key[len(_PREFIX):-len(_DRIFT)]
            pairs = float(metrics.get(_PREFIX + server + _COMPARED, 0.0))
            routing = float(metrics[_PREFIX + server + _ROUTING]) if pairs else 0.0
            out[server] = (float(value), float(metrics[_PREFIX + server + _TOKENS]), routing, pairs)
    return out


class DriftGate:
    def __init__(self, cfg: DriftGateConfig):
        self.cfg = cfg
        self.window: dict[str, list[float]] = {}
        """Per server, summed over the window so far: drift x tokens, fresh tokens, mismatched pairs,
        compared pairs."""
        self.seen: set[str] = set()
        self.tripped: set[str] = set()

    def observe(self, metrics: dict, version: int) -> list[Trip]:
        """Add one step's per-server figures; the servers that trip now."""
        trips = []
        for server, (drift, tokens, routing, pairs) in sorted(per_server(metrics).items()):
            self.seen.add(server)
            window = self.window.setdefault(server, [0.0, 0.0, 0.0, 0.0])
            for i, value in enumerate((drift * tokens, tokens, routing * pairs, pairs)):
                window[i] += value
            if window[1] < self.cfg.window_tokens:
                continue
            del self.window[server]
            judged = Trip(server, version, window[0] / window[1], int(window[1]),
                          window[2] / window[3] if window[3] else None, int(window[3]))
            if judged.trips(self.cfg):
                trips.append(judged)
                self.tripped.add(server)
            else:
                self.tripped.discard(server)
        return trips

    @property
    def every_server_tripped(self) -> bool:
        return bool(self.seen) and self.seen <= self.tripped

    def state_dict(self) -> dict:
        """The servers seen and those tripped (saved with the trainer's checkpoint); a window under
        way is not saved, so a resumed run starts new windows."""
        return {"seen": sorted(self.seen), "tripped": sorted(self.tripped)}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.tripped = set(state.get("seen", ())), set(state.get("tripped", ()))


class DriftGateError(RuntimeError):
    """Every server of the fleet tripped the drift gate: the run stops (its last step is saved)."""


class FleetGate:
    """The trainer's side of the gate (every rank calls `after_step` together): the logging rank,
    which holds the per-server figures, judges them, names each trip in the log and retires the
    server (``fleet.registry.retire``); every rank learns the trips, so that the stream source
    counts, or drops, the groups the server made before it (``fleet.drift_gate.before_trip``)."""

    def __init__(self, cfg: DriftGateConfig, fleet_dir: str | Path, is_logging_rank: bool):
        self.cfg, self.fleet_dir, self.judges = cfg, Path(fleet_dir), is_logging_rank
        self.gate = DriftGate(cfg)

    def after_step(self, metrics: dict, version: int, source) -> tuple[dict, Optional[str]]:
        """The gate's metrics for the step, and the reason to stop the run (None: go on)."""
        verdict = None
        if self.judges:
            trips = self.gate.observe(metrics, version)
            stop = self._stop_reason(trips) if self.gate.every_server_tripped else None
            for trip in trips:
                self._act(trip, retire_it=stop is None)
            verdict = (trips, stop)
        trips, stop = from_the_one_rank(verdict)
        for trip in trips:
            source.server_tripped(trip.server, trip.version, drop=self.cfg.before_trip == "drop")
        return {"gate/trips": float(len(trips)), "gate/tripped_servers": float(len(self.gate.tripped))}, stop

    def state_dict(self) -> dict:
        """Collective (every rank calls it): the judging rank's `DriftGate.state_dict`, on every rank."""
        return from_the_one_rank(self.gate.state_dict() if self.judges else None)

    def load_state_dict(self, state: dict) -> None:
        """The state of `state_dict` (every rank keeps it; only the judging rank reads it)."""
        self.gate.load_state_dict(state)

    def _act(self, trip: Trip, retire_it: bool) -> None:
        regs = [r for r in registered(self.fleet_dir) if server_key(r.url) == trip.server]
        if not retire_it or not regs:
            log.warning("drift gate: %s%s", trip.describe(self.cfg), "" if retire_it else " (the run stops)")
            return
        log.warning("drift gate: %s; taking it out of the fleet and restarting it", trip.describe(self.cfg))
        retire(self.fleet_dir, regs[0], f"drift gate: {trip.describe(self.cfg)}")

    def _stop_reason(self, trips: list[Trip]) -> str:
        named = "; ".join(t.describe(self.cfg) for t in trips)
        return (f"drift gate: every server of the fleet ({sorted(self.gate.seen)}) tripped since it last passed "
                f"({named}). The engines disagree with the trainer beyond fleet.drift_gate.max_drift (or "
                "max_routing_mismatch): check the servers' precision (--dtype and FP8 in fleet.vllm_args) and the "
                "weight updates (sync/accepted), or raise the threshold; the last step is saved, so the same command "
                "resumes.")
