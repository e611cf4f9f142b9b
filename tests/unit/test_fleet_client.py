"""FleetClient routing, retries and version tags against a stubbed HTTP transport (no vLLM)."""

import asyncio

import httpx
import pytest

from megatron_apriel.rollout.client import FleetClient, FleetUnavailable, SamplingConfig


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


def test_least_loaded_routing():
    seen = []

    async def handler(request):
        seen.append(request.url.host)
        await asyncio.sleep(0.05)
        return httpx.Response(200, json={"choices": [_choice([1], [{"version": "1", "start": 0, "end": 1}])]})

    async def go():
        client = FleetClient(["http://a", "http://b", "http://c"], transport=httpx.MockTransport(handler))
        try:
            await asyncio.gather(*(client.generate([1], SamplingConfig()) for _ in range(9)))
        finally:
            await client.aclose()

    asyncio.run(go())
    assert sorted(seen.count(h) for h in "abc") == [3, 3, 3]
