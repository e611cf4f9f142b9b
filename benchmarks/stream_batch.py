"""The trainer's stream -> batch time at the paper's scale, this checkout vs a baseline commit.

    python benchmarks/stream_batch.py [--baseline 1f2cb7a] [--groups 128] [--group-size 8]
                                      [--prompt 1024] [--completion 8192] [--repeats 3]

One step of the recipe: 128 groups x 8 rollouts of 8K completion tokens (+ a 1K prompt) in the
durable stream. Timed, on one trainer rank (DP=1, world size 1 over gloo): ``StreamSource.next_batch``
(read the stream, skip nothing, plan the step, load this rank's samples) and the packed micro-batches
of trainer.seq_len 20480, as the trainer builds them. Each side writes the stream with its own
code (the formats differ across versions; writing is not timed) and runs in its own process; the
baseline is checked out with ``git worktree`` (default: main before the restructuring of issue 19).
Prints the median of ``--repeats`` steps for each side and the ratio baseline / this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def write_stream(root: Path, groups: int, size: int, prompt: int, completion: int) -> None:
    import numpy as np

    from megatron_apriel.records.rollouts import GroupTimings, Rollout, RolloutGroup, VersionSpan
    from megatron_apriel.records.stream import ActorSnapshot, StreamWriter

    rng = np.random.default_rng(0)
    writer = StreamWriter(root)
    batch = []
    for g in range(groups):
        rollouts = [Rollout(completion_ids=rng.integers(0, 150_000, completion).tolist(),
                            logprobs=(-rng.random(completion)).astype(np.float32).tolist(),
                            versions=[VersionSpan(version=0, start=0, end=completion)], finish_reason="stop",
                            outcome="correct" if i % 2 else "wrong", score=float(i % 2), success=bool(i % 2),
                            reward=float(i % 2), advantage=(i % 2) - 0.5)
                    for i in range(size)]
        batch.append(RolloutGroup(seq=-1, problem_id=f"p{g}", domain="math",
                                  prompt_ids=rng.integers(0, 150_000, prompt).tolist(), rollouts=rollouts,
                                  admitted_version=0, timings=GroupTimings(submitted_at=0.0, generate_s=1.0,
                                                                           verify_s=0.1)))
        if len(batch) == 16:  # the actor writes segments of the groups finished since its last flush
            writer.append(batch, ActorSnapshot(next_seq=g + 1, sampler={}, order={}, in_flight=[]))
            batch = []
    if batch:
        writer.append(batch, ActorSnapshot(next_seq=groups, sampler={}, order={}, in_flight=[]))


def _imports():
    """The pieces under their names in this checkout or in the baseline (before: rollout/)."""
    try:
        from megatron_apriel.records.config import RolloutConfig
        from megatron_apriel.trainer.stream_source import StreamSource
    except ImportError:
        from megatron_apriel.rollout.source import RolloutConfig, StreamSource
    from megatron_apriel.trainer.batch import packed_microbatches

    return RolloutConfig, StreamSource, packed_microbatches


def measure(args) -> dict:
    import torch.distributed as dist

    RolloutConfig, StreamSource, packed_microbatches = _imports()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=0, world_size=1)
    ctx = SimpleNamespace(rank=0, dp_rank=0, dims=SimpleNamespace(dp=1))
    cfg = RolloutConfig(group_size=args.group_size, groups_per_step=args.groups, max_lag=None)
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        write_stream(Path(tmp), args.groups, args.group_size, args.prompt, args.completion)
        for _ in range(args.repeats):
            source = StreamSource(Path(tmp), cfg, ctx, {"math": 1.0})
            t0 = time.perf_counter()
            samples, _ = source.next_batch(0)
            mbs = packed_microbatches(samples, list(range(len(samples))), 20480)
            times.append(time.perf_counter() - t0)
            assert len(samples) == args.groups * args.group_size and mbs
            del samples, mbs
    dist.destroy_process_group()
    return {"median_s": statistics.median(times), "times_s": times}


def run_side(checkout: Path, args) -> dict:
    from megatron_apriel.parallel.rendezvous import free_port

    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--port", str(free_port()),
           *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in ("groups", "group_size", "prompt",
                                                                                   "completion", "repeats"))]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the measurement in {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="1f2cb7a", help="git ref to compare with (default: before issue 19)")
    ap.add_argument("--groups", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--completion", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline], check=True,
                       capture_output=True)
        try:
            before = run_side(base, args)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    ours = run_side(ROOT, args)
    tokens = args.groups * args.group_size * (args.prompt + args.completion)
    print(f"stream -> batch, {args.groups} groups x {args.group_size} x ({args.prompt} + {args.completion}) tokens "
          f"= {tokens / 1e6:.1f}M tokens, one rank, median of {args.repeats}:")
    print(f"  baseline {args.baseline}: {before['median_s']:.2f} s   this checkout: {ours['median_s']:.2f} s   "
          f"ratio baseline/ours: {before['median_s'] / ours['median_s']:.2f}")


if __name__ == "__main__":
    main()
