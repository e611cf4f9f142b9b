"""Async generation client for a fleet of ``apriel-serve`` servers.

    client = FleetClient(["http://node7:8000", "http://node8:8000"])
    completions = await client.generate(prompt_token_ids, SamplingConfig(max_tokens=1024), n=16)

Each request goes to the server with the fewest requests in flight from this client. A server
that fails (connection error, 5xx, or an aborted request) is put on a short cooldown and the
request is sent again, whole, to another server (or to the same one once it is back), up to
``max_attempts``: a restarted server does not lose the rollout. Completions carry the token ids,
the behaviour log-probs (vLLM's processed log-probs: after temperature) and the weight versions
their tokens were sampled under, from vLLM's per-token version spans: a sequence generated
across an in-flight weight update reports both versions.

Version gate: with ``required_version`` set (the actor sets it to the version the trainer has
pushed), a server is used only once it is known to serve at least that version (from its
completions, or from ``/weight_info``, asked when it is unknown or behind). A restarted server, which
comes back with its start-up weights, therefore takes no request until the trainer has sent it
the current weights; ``mark_restarted`` forgets what was known of a server.

Uses vLLM's token-in/token-out route ``/inference/v1/generate`` (``apriel-serve`` enables it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import httpx

from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.records.rollouts import RoutedExperts, VersionSpan
from megatron_apriel.records.weights import STARTUP_LABEL, parse_version_label

log = logging.getLogger(__name__)


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each completion token (after temperature), pi_old for the trainer."""
    finish_reason: str
    versions: list[VersionSpan]
    server: str
    attempts: int = 1
    routed_experts: Optional[RoutedExperts] = None
    """``[prompt + completion - 1, layers, k]`` expert ids, when the server returns them
    (``apriel-serve --return-routed-experts``), kept as the server sent them."""
    context_version: Optional[int] = None
    """With ``salt_cache``: the version its prefix-cache salt named, the oldest weights whose KV it
    may have attended over (-1: the server's version was unknown, so any). None: not salted."""

    @property
    def versions_seen(self) -> list[int]:
        return sorted({s.version for s in self.versions})

    @property
    def first_version(self) -> int:
        return self.versions[0].version if self.versions else -1

    @property
    def last_version(self) -> int:
        return self.versions[-1].version if self.versions else -1


class FleetUnavailable(RuntimeError):
    pass


@dataclass
class _Server:
    url: str
    in_flight: int = 0
    down_until: float = 0.0
    failures: int = 0
    version: Optional[int] = None
    """Newest weight version known to be served (None: unknown)."""
    requests: set = field(default_factory=set)
    """This client's requests in flight there (asyncio tasks), for the stall watchdog."""
    tokens: Optional[float] = None
    progress_at: float = 0.0
    """When its generated-token counter last moved (or it last got work)."""
    probe: Optional[asyncio.Task] = None
    """Its ``/weight_info`` question in progress, shared by every request waiting on it."""
    answering: bool = True
    """Whether its last ``/weight_info`` question was answered (logged when it changes)."""


def _parse_choice(choice: dict, prompt: list[int], server: str, attempts: int,
                  context_version: Optional[int] = None) -> Completion:
    content = (choice.get("logprobs") or {}).get("content") or []
    tokens = choice.get("token_ids") or []
    if len(content) != len(tokens):
        raise ValueError(f"{server} returned {len(tokens)} tokens but {len(content)} log-probs.")
    spans = [VersionSpan(version=parse_version_label(s["version"]), start=s["start"], end=s["end"])
             for s in choice.get("weight_versions") or []]
    routed = choice.get("routed_experts")
    return Completion(prompt_token_ids=list(prompt), token_ids=list(tokens), logprobs=[c["logprob"] for c in content],
                      finish_reason=choice.get("finish_reason") or "", versions=spans, server=server, attempts=attempts,
                      routed_experts=None if routed is None else RoutedExperts.from_npy_base64(routed),
                      context_version=context_version)


_TOKENS = re.compile(r"^vllm:generation_tokens_total(\{[^}]*\})?\s+([0-9.eE+]+)$", re.MULTILINE)


class FleetClient:
    def __init__(self, servers: list[str], max_attempts: int = 8, cooldown_s: float = 2.0, timeout_s: float = 3600.0,
                 max_connections: int = 512, transport: Optional[httpx.AsyncBaseTransport] = None,
                 stall_timeout_s: Optional[float] = None, salt_cache: bool = False):
        """``stall_timeout_s``: a server with requests in flight whose generated-token counter
        (``/metrics``) does not move for this long is treated as failed: its requests are sent
        again elsewhere (or to it, once it answers again). None: no watchdog. ``salt_cache``
        (``fleet.kv_on_update=keep``, where an update keeps the servers' caches): each request's
        prefix-cache salt names the newest version known to be served there, so it reuses no block
        another request computed under an older known version; ``Completion.context_version``
        says which version that was."""
        if not servers:
            raise ValueError("FleetClient needs at least one server URL.")
        self.servers = [_Server(s.rstrip("/")) for s in servers]
        self.max_attempts, self.cooldown_s = max_attempts, cooldown_s
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections),
                                       transport=transport)
        self._rr = itertools.count()
        self.required_version: Optional[int] = None
        """None: no gate. Else servers not known to serve at least this version take no request
        (see the module docstring); a server on its start-up weights never counts as current."""
        self.stall_timeout_s = stall_timeout_s
        self.salt_cache = salt_cache
        self.stalls = 0
        self._stalled: set = set()
        self._watchdog: Optional[asyncio.Task] = None

    def add_server(self, url: str) -> None:
        if url.rstrip("/") not in {s.url for s in self.servers}:
            self.servers.append(_Server(url.rstrip("/")))

    def remove_server(self, url: str) -> None:
        """Take ``url`` out (the drift gate retired it): it gets no new request; the requests in
        flight there end, or fail and go elsewhere, as with a crashed server."""
        # Its /weight_info question, if one is under way, is left to end: requests are waiting on it.
        self.servers = [s for s in self.servers if s.url != url.rstrip("/")]

    def mark_restarted(self, url: str) -> None:
        """Forget the version of ``url`` (a new instance answers there): it is asked before use."""
        for s in self.servers:
            if s.url == url.rstrip("/"):
                s.version = None

    async def aclose(self) -> None:
        tasks = [t for t in [self._watchdog, *(s.probe for s in self.servers)] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()

    async def _generated_tokens(self, server: _Server) -> Optional[float]:
        try:
            response = await self._http.get(server.url + "/metrics", timeout=5.0)
        except httpx.TransportError:
            return None
        if response.status_code != 200:
            return None
        return sum(float(m.group(2)) for m in _TOKENS.finditer(response.text))

    async def _watch(self) -> None:
        """Cancel the requests of servers that stopped producing tokens (see ``stall_timeout_s``)."""
        period = max(0.05, min(5.0, self.stall_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for server in self.servers:
                if not server.requests:
                    server.tokens = None
                    continue
                tokens = await self._generated_tokens(server)
                if tokens is not None and tokens != server.tokens:
                    server.tokens, server.progress_at = tokens, now
                elif now - server.progress_at > self.stall_timeout_s:
                    log.warning("%s produced no token for %.0fs with %d requests in flight: treating it as failed",
                                server.url, now - server.progress_at, len(server.requests))
                    self.stalls += 1
                    self._stalled |= server.requests
                    for request in server.requests:
                        request.cancel()

    def in_flight(self) -> dict[str, int]:
        return {s.url: s.in_flight for s in self.servers}

    def _current(self, s: _Server) -> bool:
        return self.required_version is None or (s.version is not None and s.version >= self.required_version)

    def _pick(self, candidates: list[_Server]) -> _Server:
        now = time.monotonic()
        up = [s for s in candidates if s.down_until <= now] or candidates
        tie = next(self._rr)
        return min(up, key=lambda s: (s.in_flight, (self.servers.index(s) - tie) % len(self.servers)))

    async def _probe(self, server: _Server) -> None:
        try:
            response = await self._http.get(server.url + "/weight_info", timeout=10.0)
            response.raise_for_status()
            label = response.json()["weight_version"]
            server.version = None if label == STARTUP_LABEL else parse_version_label(label)
        except (httpx.TransportError, httpx.HTTPStatusError) as err:
            server.down_until = time.monotonic() + self.cooldown_s
            if server.answering:
                log.info("%s did not answer /weight_info (%s); asking again every %.0fs", server.url, err,
                         self.cooldown_s)
            server.answering = False
            return
        if not server.answering:
            log.info("%s answers /weight_info again", server.url)
        server.answering = True

    def _probe_shared(self, server: _Server) -> asyncio.Future:
        """The server's ``/weight_info`` question in progress, or a new one: requests waiting for a
        version ask each server once between them, not once each (shielded: a cancelled waiter does
        not cancel the others' question)."""
        if server.probe is None or server.probe.done():
            server.probe = asyncio.ensure_future(self._probe(server))
        return asyncio.shield(server.probe)

    async def _acquire(self) -> _Server:
        """A server serving the required version; waits (up to ``timeout_s``) while none does."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            current = [s for s in self.servers if self._current(s)]
            if current:
                return self._pick(current)
            await asyncio.gather(*(self._probe_shared(s) for s in self.servers if s.down_until <= time.monotonic()))
            if any(self._current(s) for s in self.servers):
                continue
            if time.monotonic() > deadline:
                raise FleetUnavailable(f"no server reached weight version {self.required_version} in "
                                       f"{self.timeout_s}s: {[(s.url, s.version) for s in self.servers]}")
            await asyncio.sleep(min(self.cooldown_s, 1.0))

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingConfig, n: int = 1) -> list[Completion]:
        """``n`` completions of one prompt, from one server; retried elsewhere on server failure."""
        errors: list[str] = []
        for attempt in range(1, self.max_attempts + 1):
            server = await self._acquire()
            wait = server.down_until - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            server.in_flight += 1
            if self.stall_timeout_s is not None and self._watchdog is None:
                self._watchdog = asyncio.create_task(self._watch())
            if not server.requests:
                server.progress_at = time.monotonic()
            request = asyncio.ensure_future(self._once(server, prompt_token_ids, sampling, n, attempt))
            server.requests.add(request)
            try:
                out = await _stall_is_failure(request, self._stalled)
            except (httpx.TransportError, _Retryable) as err:
                server.failures += 1
                server.down_until = time.monotonic() + self.cooldown_s
                server.version = None  # it may come back as a new instance
                errors.append(f"{server.url}: {type(err).__name__}: {err}")
                log.warning("generation attempt %d on %s failed (%s); retrying", attempt, server.url, err)
                continue
            finally:
                server.in_flight -= 1
                server.requests.discard(request)
                self._stalled.discard(request)
            seen = [c.last_version for c in out if c.versions]
            if seen:
                server.version = max(server.version or 0, max(seen))
            return out
        raise FleetUnavailable(f"no server completed the request in {self.max_attempts} attempts: "
                               + " | ".join(errors))

    async def _once(self, server: _Server, prompt: list[int], sampling: SamplingConfig, n: int, attempt: int):
        body = {"request_id": f"apriel-{uuid.uuid4().hex}", "token_ids": list(prompt),
                "sampling_params": sampling.to_vllm(n)}
        context = None
        if self.salt_cache:
            context = server.version if server.version is not None else -1
            body["cache_salt"] = f"apriel-v{context}"
        response = await self._http.post(server.url + "/inference/v1/generate", json=body)
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code != 200:
            raise ValueError(f"{server.url} refused the request ({response.status_code}): {response.text[:500]}")
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        if any(c.get("finish_reason") == "abort" for c in choices):
            raise _Retryable("the server aborted the request")
        return [_parse_choice(c, prompt, server.url, attempt, context) for c in choices]

    async def weight_versions(self) -> dict[str, int]:
        out = {}
        for s in self.servers:
            response = await self._http.get(s.url + "/weight_info")
            response.raise_for_status()
            out[s.url] = parse_version_label(response.json()["weight_version"])
        return out


class _Retryable(RuntimeError):
    """A failure of the server, not of the request: send it again."""


async def _stall_is_failure(request: asyncio.Future, stalled: set):
    """``await request``, where a cancellation by the stall watchdog is a server failure (retried),
    while a cancellation of the caller still cancels it."""
    try:
        return await request
    except asyncio.CancelledError:
        if request in stalled:
            raise _Retryable("the server stopped producing tokens (stalled)") from None
        raise


__all__ = ["Completion", "FleetClient", "FleetUnavailable", "SamplingConfig", "VersionSpan"]
