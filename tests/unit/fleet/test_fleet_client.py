"""FleetClient routing, retries and version tags against a stubbed HTTP transport (no vLLM)."""

import asyncio
import json
import time

import httpx
import pytest

from megatron_apriel.fleet.client import FleetClient, FleetUnavailable
from megatron_apriel.fleet.config import SamplingConfig


def _choice(tokens, spans, finish="length"):
    return {"index": 0, "finish_reason": finish, "token_ids": tokens, "weight_versions": spans,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5 * (i + 1)} for i, t in enumerate(tokens)]}}


def test_retries_on_a_failed_server_and_reports_both_versions():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.host)
        if request.url.host == "a":
            raise httpx.ConnectError("restarting", request=request)
        spans = [{"version": "default", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
        return httpx.Response(200, json={"choices": [_choice([9, 8, 7], spans)]})

    async def go():
        client = FleetClient(["http://a", "http://b"], cooldown_s=0.01, transport=httpx.MockTransport(handler))
        try:
            return await client.generate([1, 2], SamplingConfig(max_tokens=3))
        finally:
            await client.aclose()

    (c,) = asyncio.run(go())
    assert c.token_ids == [9, 8, 7] and c.logprobs == [-0.5, -1.0, -1.5]
    assert c.versions_seen == [0, 4] and c.first_version == 0 and c.last_version == 4
    assert c.server == "http://b" and "a" in calls


def test_aborted_requests_are_resent_and_exhaustion_is_an_error():
    def handler(request):
        return httpx.Response(200, json={"choices": [_choice([1], [], finish="abort")]})

    async def go():
        client = FleetClient(["http://a"], max_attempts=3, cooldown_s=0.0, transport=httpx.MockTransport(handler))
        try:
            await client.generate([1], SamplingConfig())
        finally:
            await client.aclose()

    with pytest.raises(FleetUnavailable, match="3 attempts"):
        asyncio.run(go())


def _ok(request=None):
    return httpx.Response(200, json={"choices": [_choice([1], [{"version": "1", "start": 0, "end": 1}])]})


def test_concurrent_requests_spread_evenly():
    seen = []

    async def handler(request):
        seen.append(request.url.host)
        await asyncio.sleep(0.05)
        return _ok()

    async def go():
        client = FleetClient(["http://a", "http://b", "http://c"], transport=httpx.MockTransport(handler))
        try:
            await asyncio.gather(*(client.generate([1], SamplingConfig()) for _ in range(9)))
        finally:
            await client.aclose()

    asyncio.run(go())
    assert sorted(seen.count(h) for h in "abc") == [3, 3, 3]


def test_least_loaded_routing():
    """While one server holds a request, every new one goes to the idle servers (round-robin would
    send a third of them to the busy one)."""
    seen = []

    async def go():
        holding, release = asyncio.Event(), asyncio.Event()

        async def handler(request):
            seen.append(request.url.host)
            if not holding.is_set():  # the first request stays in flight until released
                holding.set()
                await release.wait()
            return _ok()

        client = FleetClient(["http://a", "http://b", "http://c"], transport=httpx.MockTransport(handler))
        try:
            first = asyncio.create_task(client.generate([1], SamplingConfig()))
            await holding.wait()
            later = [(await client.generate([1], SamplingConfig()))[0].server for _ in range(6)]
            release.set()
            return (await first)[0].server, later
        finally:
            await client.aclose()

    busy, later = asyncio.run(go())
    assert busy == f"http://{seen[0]}"
    assert busy not in later and len(set(later)) == 2  # both idle servers, never the busy one


def test_a_failed_server_cools_down_then_serves_again():
    failed = []

    def handler(request):
        if not failed:  # the first request's server fails once, then is healthy again
            failed.append(request.url.host)
            raise httpx.ConnectError("restarting", request=request)
        return _ok()

    async def go():
        client = FleetClient(["http://a", "http://b"], cooldown_s=1.0, transport=httpx.MockTransport(handler))
        try:
            (first,) = await client.generate([1], SamplingConfig())
            during = [(await client.generate([1], SamplingConfig()))[0].server for _ in range(4)]
            await asyncio.sleep(1.1)
            after = [(await client.generate([1], SamplingConfig()))[0].server for _ in range(4)]
            return first, during, after
        finally:
            await client.aclose()

    first, during, after = asyncio.run(go())
    down = f"http://{failed[0]}"
    assert first.server != down and first.attempts == 2
    assert down not in during  # on cooldown: skipped while another server is up
    assert down in after  # back in rotation once the cooldown is over


def test_a_lone_failed_server_is_retried_after_its_cooldown():
    times = []

    def handler(request):
        times.append(time.monotonic())
        if len(times) == 1:
            raise httpx.ConnectError("restarting", request=request)
        return _ok()

    async def go():
        client = FleetClient(["http://a"], cooldown_s=0.3, transport=httpx.MockTransport(handler))
        try:
            return await client.generate([1], SamplingConfig())
        finally:
            await client.aclose()

    (c,) = asyncio.run(go())
    assert c.attempts == 2 and len(times) == 2
    assert times[1] - times[0] >= 0.3  # no server is up: the retry waits for the cooldown, it does not hammer


def _metrics_body(tokens: float) -> str:
    return ('# HELP vllm:generation_tokens_total Number of generation tokens processed.\n'
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {tokens}\n')


def test_a_server_that_stops_producing_tokens_is_treated_as_failed():
    served = []

    async def handler(request):
        host = request.url.host
        if request.url.path == "/metrics":
            return httpx.Response(200, text=_metrics_body(7.0))  # the counter never moves
        if host == "stuck":
            await asyncio.sleep(3600)  # alive (the connection stays open) but no token ever comes
        served.append(host)
        return httpx.Response(200, json={"choices": [_choice([1, 2], [{"version": "1", "start": 0, "end": 2}])]})

    async def go():
        client = FleetClient(["http://stuck", "http://ok"], cooldown_s=5.0, stall_timeout_s=0.3,
                             transport=httpx.MockTransport(handler))
        client.servers[1].in_flight = 1  # make "stuck" the least loaded, so the first try goes there
        try:
            t0 = asyncio.get_running_loop().time()
            (c,) = await asyncio.wait_for(client.generate([1], SamplingConfig()), timeout=10)
            return c, client.stalls, asyncio.get_running_loop().time() - t0
        finally:
            await client.aclose()

    c, stalls, elapsed = asyncio.run(go())
    assert c.server == "http://ok" and c.attempts == 2 and served == ["ok"] and stalls == 1
    assert 0.3 <= elapsed < 5.0


def test_a_slow_server_that_keeps_producing_tokens_is_left_alone():
    state = {"tokens": 0.0}

    async def handler(request):
        if request.url.path == "/metrics":
            state["tokens"] += 5
            return httpx.Response(200, text=_metrics_body(state["tokens"]))
        await asyncio.sleep(1.0)  # three stall timeouts long, but tokens keep coming
        return httpx.Response(200, json={"choices": [_choice([1], [{"version": "1", "start": 0, "end": 1}])]})

    async def go():
        client = FleetClient(["http://slow"], stall_timeout_s=0.3, transport=httpx.MockTransport(handler))
        try:
            (c,) = await client.generate([1], SamplingConfig())
            return c, client.stalls
        finally:
            await client.aclose()

    c, stalls = asyncio.run(go())
    assert c.attempts == 1 and stalls == 0


def test_cancelling_the_caller_still_cancels_the_request():
    async def handler(request):
        if request.url.path == "/metrics":
            return httpx.Response(200, text=_metrics_body(1.0))
        await asyncio.sleep(3600)

    async def go():
        client = FleetClient(["http://a"], stall_timeout_s=60, transport=httpx.MockTransport(handler))
        task = asyncio.create_task(client.generate([1], SamplingConfig()))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled", client.servers[0].in_flight
        finally:
            await client.aclose()
        return "finished", None

    assert asyncio.run(go()) == ("cancelled", 0)


def test_waiting_requests_ask_a_down_server_once_between_them_and_log_each_change_once(caplog):
    """32 requests wait for the required version while the only server does not answer
    ``/weight_info`` (a restarting vLLM): one question at a time goes to it, not one per request, and
    the log says it is down once and back once (not a line per request per try)."""
    asked = {"now": 0, "most": 0, "total": 0}

    async def handler(request):
        if request.url.path != "/weight_info":
            return _ok()
        asked["now"] += 1
        asked["most"] = max(asked["most"], asked["now"])
        asked["total"] += 1
        try:
            await asyncio.sleep(0.01)  # a slow answer: the other requests are waiting meanwhile
            if asked["total"] <= 3:
                raise httpx.ConnectError("restarting", request=request)
            return httpx.Response(200, json={"weight_version": "1"})
        finally:
            asked["now"] -= 1

    async def go():
        client = FleetClient(["http://a"], cooldown_s=0.01, transport=httpx.MockTransport(handler))
        client.required_version = 1
        try:
            return await asyncio.gather(*(client.generate([1], SamplingConfig()) for _ in range(32)))
        finally:
            await client.aclose()

    with caplog.at_level("INFO", logger="megatron_apriel.fleet.client"):
        done = asyncio.run(go())
    assert len(done) == 32 and asked["total"] >= 4
    assert asked["most"] == 1
    lines = [r.getMessage() for r in caplog.records]
    assert sum("did not answer /weight_info" in m for m in lines) == 1, lines
    assert sum("answers /weight_info again" in m for m in lines) == 1, lines


@pytest.mark.parametrize("salt", [True, False], ids=["keep", "recompute"])
def test_under_keep_each_request_is_salted_with_the_version_known_served_there(salt):
    """``salt_cache`` (fleet.kv_on_update=keep): the salt names the newest version the client knows
    the server serves (-1 before it knows any), so no request reuses prefix blocks of a request
    salted with an older one; the completion says which. Without it: no salt, no context version;
    the actor's trajectory then records context versions per model turn (merged where equal)."""
    from megatron_apriel.actor.trajectory import Trajectory

    bodies, version = [], {"v": 3}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": str(version["v"])})
        bodies.append(json.loads(request.content))
        spans = [{"version": str(version["v"]), "start": 0, "end": 2}]
        return httpx.Response(200, json={"choices": [_choice([9, 8], spans, finish="stop")]})

    async def go():
        client = FleetClient(["http://a"], transport=httpx.MockTransport(handler), salt_cache=salt)
        try:
            first = await client.generate([1, 2], SamplingConfig(max_tokens=2))  # version unknown: -1
            second = await client.generate([1, 2], SamplingConfig(max_tokens=2))  # 3, learnt from the first
            version["v"] = 4
            third = await client.generate([1, 2], SamplingConfig(max_tokens=2))  # still 3 (sent before it heard)
            client.required_version = 4  # the actor's gate: asks /weight_info, then salts with 4
            fourth = await client.generate([1, 2], SamplingConfig(max_tokens=2))
            return [c for out in (first, second, third, fourth) for c in out]
        finally:
            await client.aclose()

    completions = asyncio.run(go())
    if not salt:
        assert all("cache_salt" not in b for b in bodies) and all(c.context_version is None for c in completions)
        return
    assert [b["cache_salt"] for b in bodies] == ["apriel-v-1", "apriel-v3", "apriel-v3", "apriel-v4"]
    assert [c.context_version for c in completions] == [-1, 3, 3, 4]
    t = Trajectory.single(completions[1], prompt_len=2)
    for c in completions[2:]:
        t.add_environment([5])
        t.add_turn(c)
    assert [(s.version, s.start, s.end) for s in t.context_versions] == [(3, 0, 4), (4, 4, 6)]
    assert [(s.version, s.start, s.end) for s in t.versions] == [(3, 0, 2), (4, 2, 6)]
