"""What the local launcher shows: its own messages, a progress bar and each step's metrics, read
as the trainer appends them to ``run_dir/logs/metrics.jsonl``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_apriel.metrics import CONSOLE_KEYS


def say(msg: str) -> None:
    """A launcher message on stderr (above the progress bar, if one is shown)."""
    from tqdm import tqdm

    tqdm.write(f"[apriel] {msg}", file=sys.stderr)


class MetricsTail:
    """The metrics lines the trainer appended since the last read (a line still being written is
    read next time); keeps the rollout reward of every step."""

    def __init__(self, path: Path):
        self.path = path
        self.pos = path.stat().st_size if path.exists() else 0  # a resumed run's earlier steps are not shown
        self.rewards: list[float] = []

    def new_lines(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.pos)
            lines = f.readlines()
            self.pos = f.tell()
        out = []
        for line in lines:
            if not line.endswith("\n"):
                self.pos -= len(line)
                break
            out.append(json.loads(line))
        self.rewards += [m["rollout/reward"] for m in out if "rollout/reward" in m]
        return out

    def show(self, bar) -> None:
        """Advance ``bar`` (tqdm) to the newest step and print each new step's console metrics."""
        for m in self.new_lines():
            bar.update(m["step"] + 1 - bar.n)
            shown = " ".join(f"{k.split('/')[-1]}={m[k]:.4g}" for k in CONSOLE_KEYS if k in m)
            bar.write(f"step {m['step']} | {shown}", file=sys.stderr)

    def summary(self) -> str:
        """Reward of the first and the last steps (10 each, fewer in a short run); empty without any."""
        if not self.rewards:
            return ""
        k = min(10, len(self.rewards))
        return (f"reward {sum(self.rewards[:k]) / k:.3f} (first {k} steps) -> "
                f"{sum(self.rewards[-k:]) / k:.3f} (last {k})")
