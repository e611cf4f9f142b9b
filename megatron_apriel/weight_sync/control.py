"""HTTP control plane, trainer side: vLLM's native RL routes on every server of the fleet.

Used by the trainer's coordinator rank only. Each call goes to all servers concurrently and
raises, naming the server and its answer, if one fails; ``update_weights`` instead returns the
rejections, because a rejected update is an expected outcome (the server keeps its old weights).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import httpx

from megatron_apriel.records.weights import (
    TransferInit,
    UpdateRequest,
    UpdateResult,
    parse_version_label,
    version_label,
)
from megatron_apriel.weight_sync.engine_counters import EngineCounters, parse_counters

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class Probe:
    """What one ``/weight_info`` request found."""

    version: Optional[int] = None
    """The served weight version; None when the server gave none."""
    busy: bool = False
    """It took the connection but did not answer in time: a loaded server, not a dead one (a dead
    one refuses the connection)."""


def probe_versions(servers: list[str], timeout_s: float = 5.0) -> dict[str, Probe]:
    """Each server's served weight version (``/weight_info``)."""
    def one(url: str) -> Probe:
        try:
            response = httpx.get(url + "/weight_info", timeout=timeout_s)
        except httpx.ReadTimeout:
            return Probe(busy=True)
        except httpx.TransportError:
            return Probe()
        if response.status_code != 200:
            return Probe()
        return Probe(version=parse_version_label(response.json()["weight_version"]))

    with ThreadPoolExecutor(max_workers=max(1, min(32, len(servers)))) as pool:
        return dict(zip(servers, pool.map(one, servers)))


class WeightSyncControl:
    def __init__(self, servers: list[str], timeout_s: float = 600.0, keep_kv: bool = False):
        """``keep_kv``: ``/pause`` keeps the running requests' KV cache (``clear_cache=false``); else
        vLLM clears it, and the running requests compute their prefixes again after the update."""
        if not servers:
            raise ValueError("weight_sync.servers is empty: give the base URL of every vLLM server.")
        self.servers = [s.rstrip("/") for s in servers]
        self.keep_kv = keep_kv
        self._http = httpx.Client(timeout=timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self.servers)), thread_name_prefix="apriel-ctl")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def _call(self, server: str, method: str, path: str, **kwargs) -> httpx.Response:
        response = self._http.request(method, server + path, **kwargs)
        if response.status_code != 200:
            raise ServerError(f"{method} {server}{path} -> {response.status_code}: {response.text[:500]}")
        return response

    def _all(self, method: str, path: str, **kwargs) -> list[httpx.Response]:
        futures = [self._pool.submit(self._call, s, method, path, **kwargs) for s in self.servers]
        return [f.result() for f in futures]

    def workers_per_server(self) -> list[int]:
        return [r.json()["world_size"] for r in self._all("GET", "/get_world_size")]

    def init_async(self, inits: list[TransferInit]):
        """Start ``/init_weight_transfer_engine`` on every server; the caller joins its own group
        meanwhile (the call returns once every worker joined), then waits on the futures."""
        return [self._pool.submit(self._call, s, "POST", "/init_weight_transfer_engine",
                                  json={"init_info": i.model_dump()}) for s, i in zip(self.servers, inits)]

    def start(self) -> None:
        self._all("POST", "/start_weight_update")

    def pause(self) -> None:
        """Freeze the running requests (``mode=keep``: not aborted); ``clear_cache`` as ``keep_kv`` says."""
        self._all("POST", "/pause", params={"mode": "keep", "clear_cache": "false" if self.keep_kv else "true"})

    def resume(self) -> None:
        self._all("POST", "/resume")

    def request_counters(self) -> dict[str, Future]:
        """Start reading every server's vLLM counters (``/metrics``); ``collect_counters`` waits.
        Sent while the fleet is paused, they are answered while the weights load."""
        return {s: self._pool.submit(self._call, s, "GET", "/metrics") for s in self.servers}

    def collect_counters(self, requests: dict[str, Future]) -> dict[str, EngineCounters]:
        """The counters ``request_counters`` asked for. They are figures, not control: a server that
        does not answer them, or not in Prometheus text, is left out with a warning."""
        out = {}
        for server, future in requests.items():
            try:
                out[server] = parse_counters(future.result().text)
            except (ServerError, httpx.TransportError, ValueError) as err:
                log.warning("%s/metrics: %s; its counters are left out of this update's sync/* figures", server, err)
        return out

    def update(self, request: UpdateRequest) -> dict[str, str]:
        """``/update_weights`` on every server; returns {server: reason} for those that rejected."""
        def one(server: str) -> Optional[str]:
            # vLLM's route lets the worker's exception escape: the answer is a 500 or, with some
            # versions, a dropped connection. Either way the receiver's own status says why.
            try:
                response = self._http.post(server + "/update_weights", json={"update_info": request.model_dump()})
                if response.status_code == 200:
                    return None
                answer = f"HTTP {response.status_code}: {response.text[:500]}"
            except httpx.TransportError as err:
                answer = f"{type(err).__name__}: {err}"
            result = self.status(server)
            if result is not None and result.version == request.version and not result.accepted:
                return result.reason
            raise ServerError(f"/update_weights on {server} failed ({answer}) and its receiver reports no "
                              f"rejection of version {request.version}: the server may be down.")

        futures = {s: self._pool.submit(one, s) for s in self.servers}
        return {s: r for s, f in futures.items() if (r := f.result()) is not None}

    def finish(self, servers: list[str], version: int) -> None:
        futures = [self._pool.submit(self._call, s, "POST", "/finish_weight_update",
                                     json={"weight_version": version_label(version)}) for s in servers]
        for f in futures:
            f.result()

    def abort(self) -> list[str]:
        """End an interrupted update on every server, keeping its weight version label
        (``/finish_weight_update`` without a version), so the next ``start`` is accepted. A
        server with no update open refuses ("without a matching start"), which is as good; one
        that does not answer is left to the reconnection. Returns the servers that did not answer."""
        def one(server: str) -> Optional[str]:
            try:
                response = self._http.post(server + "/finish_weight_update", json={})
            except httpx.TransportError:
                return server
            if response.status_code != 200 and "without a matching start" not in response.text:
                raise ServerError(f"/finish_weight_update on {server} -> {response.status_code}: {response.text[:500]}")
            return None

        return [s for s in self._pool.map(one, self.servers) if s is not None]

    def status(self, server: str) -> Optional[UpdateResult]:
        """The receiver's last ``UpdateResult`` (first worker), via ``/collective_rpc``."""
        # A fresh connection: after a failed update the pooled one may have been dropped by the server.
        response = httpx.post(server + "/collective_rpc", json={"method": "apriel_weight_sync_status"},
                              timeout=self._http.timeout)
        if response.status_code != 200:
            raise ServerError(f"/collective_rpc on {server} -> {response.status_code}: {response.text[:500]}")
        first = response.json()["results"][0]
        return None if first == "null" else UpdateResult.model_validate(json.loads(first))

    def weight_versions(self) -> dict[str, str]:
        return {s: r.json()["weight_version"] for s, r in zip(self.servers, self._all("GET", "/weight_info"))}
