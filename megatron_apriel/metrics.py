"""Metrics: one tiny interface, ``log(metrics, step)`` + ``close()``; TensorBoard and console.

Only the logging rank (last pipeline stage, first TP/DP rank) writes. Keys are namespaced:
``train/``, ``rollout/``, ``sync/``, ``domain/<d>/``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Protocol

from megatron_apriel.run_dir import METRICS_FILE, RunDir  # noqa: F401  (METRICS_FILE: re-exported)

log = logging.getLogger("megatron_apriel")


class MetricLogger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class ConsoleLogger:
    def __init__(self, keys: tuple[str, ...] = ()):
        self.keys = keys  # shown, in this order (all of them, sorted, when empty); TensorBoard has the rest

    def log(self, metrics: dict[str, float], step: int) -> None:
        ordered = [k for k in self.keys if k in metrics] if self.keys else sorted(metrics)
        log.info("step %d | %s", step, " ".join(f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in ordered))

    def close(self) -> None:
        pass


class TensorBoardLogger:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class JsonlLogger:
    """One JSON object per step (``{"step": n, ...metrics}``) appended to a file: what the launcher's
    progress display and scripts (jq, pandas) read."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class MultiLogger:
    def __init__(self, *loggers: MetricLogger):
        self.loggers = loggers

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


CONSOLE_KEYS = ("rollout/reward", "rollout/success", "train/loss", "train/grad_norm", "train/clip_fraction",
                "train/drift_abs_mean", "rollout/lag_mean", "sync/total_s", "time/step_s")
"""Shown first on each step's console line, in this order."""


def build_logger(run_dir: Path, enabled: bool) -> MetricLogger:
    """TensorBoard under ``run_dir/tensorboard``, the console and ``run_dir/logs/metrics.jsonl``,
    on the logging rank only."""
    if not enabled:
        return MultiLogger()
    return MultiLogger(ConsoleLogger(CONSOLE_KEYS), TensorBoardLogger(RunDir(run_dir).tensorboard),
                       JsonlLogger(RunDir(run_dir).metrics))
