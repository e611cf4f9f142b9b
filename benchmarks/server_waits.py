"""Short tiny_cpu runs with the CPU server's engine and worker waiting for each other in naps
(ours, ``_patches.idle_vllm_cpu_waits``) or spinning on ``sched_yield`` (vLLM's own,
``APRIEL_VLLM_SPIN_WAITS=1``).

    PYTHONPATH=. python benchmarks/server_waits.py [--rounds 2 --steps 12]

Each round runs ``apriel-train --config-name tiny_cpu trainer.steps=STEPS`` once per kind, one
after the other (never side by side), on a copy of one tiny base built first (so no run builds
it). Per run: wall seconds and the CPU seconds of its whole process tree (the children's rusage:
vLLM's engine and worker, the actor, the trainer ranks, the launcher). Prints medians over the
rounds and the ratios naps / spin. No assertions: numbers only.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_apriel._patches import SPIN_ENV
from megatron_apriel.tiny.base import build_warm_base
from megatron_apriel.tiny.config import TinyBaseConfig

KINDS = {"naps": "0", "spin": "1"}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(base: Path, work: Path, steps: int, spin: str) -> tuple[float, float]:
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(base, run_dir / "base")
    exe = str(Path(sys.executable).with_name("apriel-train"))
    env = {**os.environ, SPIN_ENV: spin}
    cpu, began = children_cpu(), time.monotonic()
    proc = subprocess.run([exe, "--config-name", "tiny_cpu", f"run_dir={run_dir}", f"trainer.steps={steps}"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return time.monotonic() - began, children_cpu() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = build_warm_base(Path(tmp) / "base", TinyBaseConfig())
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
        for r in range(args.rounds):
            for kind, spin in KINDS.items():
                wall, cpu = one_run(base, Path(tmp), args.steps, spin)
                results[kind].append((wall, cpu))
                print(f"round {r + 1}: {kind:5s} {wall:6.1f} s wall, {cpu:6.1f} CPU-s", flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in results.items()}
    for kind, (wall, cpu) in med.items():
        print(f"median {kind:5s}: {wall:6.1f} s wall, {cpu:6.1f} CPU-s ({args.steps} steps)")
    print(f"naps / spin: wall x{med['naps'][0] / med['spin'][0]:.2f}, CPU x{med['naps'][1] / med['spin'][1]:.2f}")


if __name__ == "__main__":
    main()
