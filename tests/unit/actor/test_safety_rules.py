"""Each safety rule of the loop on both sides of its boundary: the admission bound and the backlog
cap (lag.may_admit), the version gate of the fleet client, and the drop rules of a group."""

import asyncio

import httpx
import pytest

from megatron_apriel.actor.grouping import build_group
from megatron_apriel.fleet.client import FleetClient, FleetUnavailable
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.records.lag import may_admit
from megatron_apriel.records.rollouts import GroupTimings, Outcome
from megatron_apriel.records.stream import TrainerProgress
from megatron_apriel.rewards import RewardConfig, is_zero_advantage_group
from megatron_apriel.tiny.base import addition_problems
from megatron_apriel.verifiers.base import VerifierResult, correct, failed
from tests.unit.actor.test_actor import completion


@pytest.mark.parametrize("step,filled,version,oldest,gps,max_lag", [
    (0, 0, 0, None, 4, 0), (4, 1, 4, None, 2, 0), (7, 3, 6, None, 4, 1), (7, 3, 6, 5, 4, 2), (10, 0, 10, 8, 3, 3),
])
def test_the_admission_bound_admits_the_last_group_within_max_lag_and_not_one_more(step, filled, version, oldest,
                                                                                     gps, max_lag):
    """The group at position q is trained by step ``step + (filled + q) // gps`` at the latest; its
    oldest weights are the older of the published version and the oldest in flight."""
    progress = TrainerProgress(step=step, filled=filled, cursor=0, version=version)
    base = version if oldest is None else min(version, oldest)
    last = (max_lag + base - step + 1) * gps - 1 - filled  # the last position that is trained in time
    assert last >= 0, "a case where some group may start"

    def admit(queued):
        return may_admit(progress=progress, queued=queued, groups_per_step=gps, max_lag=max_lag, max_queued=10**6,
                         oldest_in_flight=oldest)

    assert admit(last) and not admit(last + 1)


@pytest.mark.parametrize("max_lag", [None, 5])
def test_the_backlog_cap_counts_every_group_dropped_ones_included(max_lag):
    progress = TrainerProgress(step=0, filled=0, cursor=0, version=0)

    def admit(backlog):
        return may_admit(progress=progress, queued=0, groups_per_step=4, max_lag=max_lag, max_queued=8,
                         backlog=backlog)

    assert admit(7) and not admit(8)  # nothing usable ahead (all dropped), the stream still may not grow


def served(versions: dict[str, str], hits: list):
    """Servers at fixed weight versions (``/weight_info``), noting which host served a request."""
    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": versions[host]})
        hits.append(host)
        label = versions[host]
        return httpx.Response(200, json={"choices": [{
            "index": 0, "finish_reason": "length", "token_ids": [1], "weight_versions": [
                {"version": label, "start": 0, "end": 1}],
            "logprobs": {"content": [{"token_id": 1, "logprob": -1.0}]}}]})
    return httpx.MockTransport(handler)


@pytest.mark.parametrize("required,expected", [(3, {"b"}), (2, {"a", "b"}), (None, {"a", "b", "c"})])
def test_the_version_gate_uses_servers_at_the_required_version_or_newer(required, expected):
    hits: list = []

    async def go():
        client = FleetClient(["http://a", "http://b", "http://c"], timeout_s=5.0,
                             transport=served({"a": "2", "b": "3", "c": "default"}, hits))
        client.required_version = required
        try:
            for _ in range(12):
                await client.generate([1], SamplingConfig(max_tokens=1))
        finally:
            await client.aclose()

    asyncio.run(go())
    assert set(hits) == expected  # "default": a server that never got weights serves no gated request


def test_the_version_gate_refuses_when_no_server_reaches_the_version():
    async def go():
        client = FleetClient(["http://a"], timeout_s=0.3, cooldown_s=0.05, transport=served({"a": "2"}, []))
        client.required_version = 3
        try:
            await client.generate([1], SamplingConfig(max_tokens=1))
        finally:
            await client.aclose()

    with pytest.raises(FleetUnavailable, match="no server reached weight version 3"):
        asyncio.run(go())


def test_zero_advantage_is_within_the_tolerance_inclusive():
    assert is_zero_advantage_group([1e-6, -1e-6], tol=1e-6) and not is_zero_advantage_group([1e-6, -1.1e-6], tol=1e-6)


@pytest.mark.parametrize("filter_on,verdicts,dropped", [
    (True, ["wrong", "wrong"], "zero_advantage"),
    (False, ["wrong", "wrong"], None),
    (True, ["correct", "wrong"], None),
    (True, ["wrong", "error"], "verifier_error"),  # before the advantage filter: a verdict nobody knows
    (False, ["correct", "error"], "verifier_error"),
])
def test_the_drop_rules_of_a_group(filter_on, verdicts, dropped):
    made = {"correct": correct(), "wrong": failed(Outcome.WRONG),
            "error": VerifierResult(0.0, False, Outcome.VERIFIER_ERROR, "boom")}
    group = build_group(problem=addition_problems(1)[0], prompt_ids=[1], completions=[completion([5] * 3)] * 2,
                        results=[made[v] for v in verdicts],
                        rewards=RewardConfig(max_len=10, buffer=4, filter_zero_advantage_groups=filter_on),
                        admitted_version=0, timings=GroupTimings(submitted_at=0.0, generate_s=0.0, verify_s=0.0))
    assert group.dropped == dropped
