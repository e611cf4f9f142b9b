"""The run directory: its layout and its small file protocols, in one place. Every component asks a
`RunDir` where things are; nothing else spells these paths (the layout is part of the public
contract: tools and users read it).

    RUN_DIR/
      config.yaml      the run's resolved config (written once, by the first trainer rank)
      base/            the tiny presets' built base model (tiny_base.enabled)
      rollouts/        the durable stream, and the trainer's progress (records/stream.py)
      checkpoints/     step_NNNNNNNN/ and ``latest`` (trainer/checkpoint.py)
      fleet/           one registration per healthy vLLM server (fleet/registry.py)
      tensorboard/     the trainer's scalars; actor/ the actor's
      logs/            <component>.log and metrics.jsonl
      hf/              the final checkpoint in Hugging Face format
      slurm/           the jobs apriel-submit rendered, and their logs
      .cache/          the components' own caches (matplotlib's font cache)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FLEET_DIR = "fleet"
METRICS_FILE = "logs/metrics.jsonl"


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def base(self) -> Path:
        return self.root / "base"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def fleet(self) -> Path:
        return self.root / FLEET_DIR

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def actor_tensorboard(self) -> Path:
        return self.tensorboard / "actor"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, component: str) -> Path:
        """``logs/<component>.log``: a component's stdout and stderr."""
        return self.logs / f"{component}.log"

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def slurm(self) -> Path:
        return self.root / "slurm"

    @property
    def cache(self) -> Path:
        return self.root / ".cache"

    def clear_registrations(self) -> list[Path]:
        """Remove the fleet registrations an earlier launch or job attempt left (their servers are
        gone); returns what was removed."""
        stale = sorted(self.fleet.glob("*.json"))
        for path in stale:
            path.unlink(missing_ok=True)
        return stale
