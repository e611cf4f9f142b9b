"""A real vLLM server that stops answering without dying (SIGSTOP of all its processes: a hung
node, a GPU stuck in a kernel) is caught by the fleet client's stall watchdog, and the requests it
held are sent to the other server. Nothing here depends on timing: the server is stopped before
the requests are sent, so its share of them can only come back through the watchdog.

Two servers: the session's (healthy) and one started here (the one stopped); it is continued and
stopped at the end.
"""

import asyncio

import psutil
import pytest

from megatron_apriel.fleet.client import FleetClient, SamplingConfig
from megatron_apriel.fleet.registry import start_server
from megatron_apriel.parallel.rendezvous import free_port

pytestmark = pytest.mark.vllm
STALL_S = 15.0
"""Long beside the healthy server's answers (16 tokens of a tiny model), short for a test."""


def family(pid: int) -> list[psutil.Process]:
    """apriel-serve, the vLLM server it supervises and vLLM's engine and workers."""
    return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]


def test_a_stopped_server_is_caught_by_the_stall_watchdog_and_its_requests_moved(vllm_server, tiny_model_dir,
                                                                                  tmp_path):
    stuck = start_server(tiny_model_dir, free_port(), tmp_path / "stuck.log",
                         extra_args=["--max-model-len", "512", "--max-num-seqs", "8"])
    stopped = []
    try:
        stuck.wait_healthy(timeout_s=240)
        stopped = family(stuck.process.pid)
        for p in stopped:
            p.suspend()  # SIGSTOP: alive, its socket accepts, nothing answers

        async def go():
            # cooldown: once caught, the stopped server gets no retry while this test runs
            client = FleetClient([stuck.url, vllm_server.url], cooldown_s=600, stall_timeout_s=STALL_S, max_attempts=3,
                                 timeout_s=180)  # without the watchdog: a read timeout, no stall
            try:
                sampling = SamplingConfig(max_tokens=16, ignore_eos=True)
                out = await asyncio.gather(*(client.generate([1, 2, 3 + i], sampling) for i in range(4)))
                return [c for group in out for c in group], client.stalls
            finally:
                await client.aclose()

        completions, stalls = asyncio.run(go())
    finally:
        for p in stopped:
            p.resume()
        stuck.stop()
    assert len(completions) == 4 and all(len(c.token_ids) == 16 for c in completions)
    assert {c.server for c in completions} == {vllm_server.url}
    moved = [c for c in completions if c.attempts > 1]
    assert moved and stalls >= 1  # the ones first sent to the stopped server came back through the watchdog
