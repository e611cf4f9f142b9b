"""Megatron (TP=2 / PP=2, 2 ranks, gloo) -> running vLLM server, end to end on CPU.

For each layout: weights pushed while 16 long requests are decoding (held there by a pause as soon
as the client has sent them, so the push lands mid-way on any machine); every request completes
(none aborted) and reports the versions its tokens came from; under ``fleet.kv_on_update=recompute``
(TP=2) the update preempts every running request, which computes its prefix again with the new
weights (vLLM's preemption counter), under ``keep`` (PP=2) none is; the server's prompt log-probs then
equal the trainer's (fp32, atol 1e-4); a push with one flipped byte is rejected, the server keeps
serving the previous weights and version, and says why (TP=2: the byte is in a tensor sent from
its own memory, the zero-copy path; PP=2: in a packed bucket).
"""

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from megatron_apriel.fleet.client import FleetClient
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.records.weights import parse_version_label

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "dist"))
from weight_sync_push import PROMPTS  # noqa: E402

pytestmark = pytest.mark.vllm


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} before {path.name}:\n"
                                 f"{proc.stdout.read()[-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {path.name}"
        time.sleep(0.05)


def server_prompt_logprobs(url: str) -> list[list[float]]:
    out = []
    for prompt in PROMPTS:
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}}
        response = httpx.post(url + "/inference/v1/generate", json=body, timeout=60)
        response.raise_for_status()
        out.append([next(iter(e.values()))["logprob"] for e in response.json()["prompt_logprobs"][1:]])
    return out


def metrics(url: str, *names: str) -> list[float]:
    """Prometheus series of the server's /metrics (one scrape), each summed over its labels."""
    lines = httpx.get(url + "/metrics", timeout=60).text.splitlines()
    return [sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + "{", name + " ")))
            for name in names]


TOKENS, FINISHED = "vllm:generation_tokens_total", "vllm:request_success_total"
PREEMPTED = "vllm:num_preemptions_total"
HOLD = {"mode": "keep", "clear_cache": "false"}


class _Sent(httpx.AsyncBaseTransport):
    """The client's transport, telling when it has sent ``n`` generation requests."""

    def __init__(self, n: int, sent: threading.Event):
        self.inner, self.n, self.sent, self.count = httpx.AsyncHTTPTransport(), n, sent, 0

    async def handle_async_request(self, request):
        self.count += request.url.path.endswith("/generate")
        if self.count >= self.n:
            self.sent.set()
        return await self.inner.handle_async_request(request)

    async def aclose(self):
        await self.inner.aclose()


def start_held_requests(url: str, n: int, completions: list, tries: int = 3) -> threading.Thread:
    """``n`` long requests under way on a paused server, so that the push that follows lands while
    they decode (its own pause and resume take over). The server is paused as soon as the client
    has sent them, then let run a step at a time (resume, pause) until it has generated a token;
    the counters are read only while it is paused and idle. (Scraping /metrics while it decodes
    took ~2 s here, as long as the whole batch.) A batch that finished anyway is tried again. The
    hold keeps the requests' KV cache (``clear_cache=false``): a preemption there would be counted
    only once the requests run again, inside the push, whose own pause is under test."""
    for _ in range(tries):
        completions.clear()
        before = metrics(url, TOKENS, FINISHED)
        sent = threading.Event()
        thread = run_in_flight(url, n, completions, _Sent(n, sent))
        assert sent.wait(300), "the client never sent its requests"
        httpx.post(url + "/pause", params=HOLD, timeout=60).raise_for_status()
        tokens, finished = metrics(url, TOKENS, FINISHED)
        deadline = time.monotonic() + 300
        while tokens == before[0] and finished == before[1]:
            assert thread.is_alive() and time.monotonic() < deadline, "the requests never reached the server"
            httpx.post(url + "/resume", timeout=60).raise_for_status()
            httpx.post(url + "/pause", params=HOLD, timeout=60).raise_for_status()
            tokens, finished = metrics(url, TOKENS, FINISHED)
        if finished == before[1]:
            return thread
        httpx.post(url + "/resume", timeout=60).raise_for_status()
        thread.join(120)
    raise AssertionError(f"the {n} requests finished before the hold in {tries} tries")


def run_in_flight(url: str, n: int, results: list, transport=None) -> threading.Thread:
    async def go():
        client = FleetClient([url], transport=transport)
        sampling = SamplingConfig(max_tokens=440, temperature=1.0, ignore_eos=True)
        try:
            outs = await asyncio.gather(*(client.generate([7 + i, 11, 13], sampling) for i in range(n)))
            results.extend(c for group in outs for c in group)
        finally:
            await client.aclose()

    thread = threading.Thread(target=lambda: asyncio.run(go()))
    thread.start()
    return thread


def start_pusher(layout: str, url: str, model: str, work: Path, version: int, *extra: str) -> subprocess.Popen:
    """tests/dist/weight_sync_push.py on 2 ranks, in a session of its own (killed as a group)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port", str(free_port()),
           str(ROOT / "tests" / "dist" / "weight_sync_push.py"), "--layout", layout, "--server", url,
           "--model", str(model), "--work", str(work), "--version", str(version), "--port", str(free_port()), *extra]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


@pytest.mark.parametrize("layout,version,kv", [("tp2", 1, "recompute"), ("pp2", 3, "keep")])
def test_push_from_megatron_in_flight_and_corrupted(layout, version, kv, vllm_server, tiny_model_dir, tmp_path):
    url = vllm_server.url
    previous = parse_version_label(httpx.get(url + "/weight_info").json()["weight_version"])
    proc = start_pusher(layout, url, tiny_model_dir, tmp_path, version, *(["--keep-kv"] if kv == "keep" else []))
    try:
        wait_for(tmp_path / "ready", proc)
        completions: list = []
        thread = start_held_requests(url, 16, completions)
        [preempted] = metrics(url, PREEMPTED)  # the server is paused here, the 16 requests in it
        (tmp_path / "go1").touch()
        wait_for(tmp_path / "done1", proc)
        thread.join(120)
        step1 = torch.load(tmp_path / "step1.pt")
        assert step1["report"]["accepted"], step1["report"]
        [preempted_after] = metrics(url, PREEMPTED)
        if kv == "keep":  # the running requests kept their cache through the update
            assert preempted_after == preempted
        else:  # vLLM's pause cleared it: each running request was preempted, its prefix computed again
            assert preempted_after > preempted

        # in-flight requests: all complete, none aborted, tagged with the versions they saw
        assert len(completions) == 16
        assert all(c.finish_reason == "length" and len(c.token_ids) == 440 for c in completions)
        assert all(set(c.versions_seen) <= {previous, version} for c in completions)
        spanning = [c for c in completions if c.versions_seen == sorted({previous, version})]
        # held mid-way: the ones that had decoded before the hold span both versions (a request the
        # engine had not reached yet, if it ran in a later wave, may have only new-version tokens)
        assert spanning, [c.versions for c in completions]
        for c in spanning:
            assert c.first_version == previous and c.last_version == version
            assert c.versions[0].start == 0 and c.versions[-1].end == 440

        # every tensor arrived in the right place: the server now scores like the trainer
        served = server_prompt_logprobs(url)
        for got, want in zip(served, step1["logprobs"], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
        assert httpx.get(url + "/weight_info").json()["weight_version"] == str(version)

        # a corrupted bucket: rejected whole, old weights and version kept, reason reported
        (tmp_path / "go2").touch()
        wait_for(tmp_path / "done2", proc)
        report = torch.load(tmp_path / "step2.pt")["report"]
        assert not report["accepted"]
        assert "corrupted bucket" in report["rejected"][url] and "checksum" in report["rejected"][url]
        kind = "direct" if layout == "tp2" else "packed"
        assert f"{kind} bucket" in report["rejected"][url], report["rejected"][url]
        assert server_prompt_logprobs(url) == served
        assert httpx.get(url + "/weight_info").json()["weight_version"] == str(version)
        assert proc.wait(60) == 0, proc.stdout.read()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
