"""Run test modules several times in a row while busy processes load the CPU (issue 22: tests must
hold on a busy CI machine). Stops at the first failing pass; prints each module's time per pass and
any process of ours a pass left running (run it alone: it cannot tell them from another job's).
Before each pass it times a fixed CPU workload (the machine's own speed, which nothing of ours
changes) and measures what earlier passes left on disk and in memory (temp folders, caches, shared
memory, the page cache): if a pass is slower, this tells a slower machine from our leftovers.

    python tools/under_load.py --passes 3 --busy 2 -- tests/vllm tests/slurm
    python tools/under_load.py --passes 3 --busy 0 -- tests/vllm/test_loop_e2e.py   # pass-to-pass drift

Everything after ``--`` goes to pytest (run with CI=true, as .ci/run does). Each pass's full
pytest output is kept in OUT/pass_N.log (``--out``, default runs/under_load).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

BUSY = [sys.executable, "-c", "while True: pass"]
OURS = ("vllm", "megatron_apriel", "apriel-")


def module_seconds(pytest_output: str) -> dict[str, float]:
    """Setup + call + teardown of each module's tests, from ``--durations=0`` lines."""
    out: dict[str, float] = defaultdict(float)
    for m in re.finditer(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+?)::", pytest_output, re.M):
        out[m.group(2)] += float(m.group(1))
    return dict(out)


LEFT_BEHIND = ("/tmp/pytest-of-{user}", "/tmp/torchinductor_{user}", "~/.cache/vllm", "~/.cache/huggingface",
               "/dev/shm", "/var/spool/slurmctld", "/tmp")


def calibrate(repeats: int = 5) -> float:
    """Median seconds of a fixed CPU workload (pure Python and a float32 matmul loop, one core)."""
    code = ("import time, torch; torch.set_num_threads(1); a = torch.ones(256, 256); t = time.perf_counter()\n"
            "s = sum(i * i for i in range(8_000_000))\n"
            "for _ in range(1000): a = (a @ a).clamp_(0, 1)\n"
            "print(time.perf_counter() - t)")
    runs = sorted(float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout) for _ in range(repeats))
    return runs[len(runs) // 2]


def tree_size(path: Path) -> tuple[int, int]:
    """(bytes, files) under ``path``; (0, 0) when it is missing."""
    total = count = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
                count += 1
            except FileNotFoundError:
                continue  # removed while we walked
    return total, count


def left_behind() -> dict[str, str]:
    """Sizes of the places a test run writes to and never cleans up itself, and the memory state."""
    user = os.environ.get("USER") or psutil.Process().username()
    out = {}
    for pattern in LEFT_BEHIND:
        path = Path(os.path.expanduser(pattern.format(user=user)))
        size, files = tree_size(path)
        out[str(path)] = f"{size / 2**20:9.1f} MiB {files:7d} files"
    mem = psutil.virtual_memory()
    out["memory"] = f"available {mem.available / 2**30:.1f} GiB, cached {getattr(mem, 'cached', 0) / 2**30:.1f} GiB"
    out["processes"] = str(len(psutil.pids()))
    return out


def ours() -> dict[int, str]:
    """Our processes now (vLLM, our package and commands), by pid."""
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if any(k in line for k in OURS) and "under_load.py" not in line:
            found[p.info["pid"]] = line[:160]
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--busy", type=int, default=2, help="busy processes beside the tests")
    p.add_argument("--out", type=Path, default=Path("runs/under_load"))
    p.add_argument("pytest_args", nargs="+", help="after --: what pytest runs")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    busy = [subprocess.Popen(BUSY) for _ in range(args.busy)]
    env = {**os.environ, "CI": "true"}
    try:
        for n in range(1, args.passes + 1):
            speed = calibrate()
            print(f"pass {n}: the fixed CPU workload took {speed:.3f}s; before the pass:")
            for where, what in left_behind().items():
                print(f"  {where:40s} {what}")
            before, t0 = ours(), time.monotonic()  # what ran already is not this pass's
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--durations=0", "-p", "no:cacheprovider",
                                   *args.pytest_args], capture_output=True, text=True, env=env)
            log = args.out / f"pass_{n}.log"
            log.write_text(proc.stdout + proc.stderr)
            summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
            print(f"pass {n} of {args.passes}, {args.busy} busy process(es): {summary} ({time.monotonic() - t0:.0f}s; "
                  f"{log})")
            for module, s in sorted(module_seconds(proc.stdout).items()):
                print(f"  {module:50s} {s:7.0f}s")
            if left := [f"{pid} {line}" for pid, line in ours().items() if pid not in before]:
                print("  left running after the pass:\n    " + "\n    ".join(left))
            if proc.returncode != 0:
                return proc.returncode
    finally:
        for b in busy:
            b.kill()
            b.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
