"""Metrics: one tiny interface, ``log(metrics, step)`` + ``close()``; TensorBoard and console.

Only the logging rank (last pipeline stage, first TP/DP rank) writes. Keys are namespaced:
``train/``, ``rollout/``, ``sync/``, ``domain/<d>/``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

log = logging.getLogger("megatron_apriel")


class MetricLogger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class ConsoleLogger:
    def __init__(self, keys: tuple[str, ...] = ()):
        self.keys = keys  # shown first, in this order; the rest follow sorted

    def log(self, metrics: dict[str, float], step: int) -> None:
        ordered = [k for k in self.keys if k in metrics] + sorted(k for k in metrics if k not in self.keys)
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


class MultiLogger:
    def __init__(self, *loggers: MetricLogger):
        self.loggers = loggers

    def log(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def build_logger(run_dir: Path, enabled: bool) -> MetricLogger:
    """TensorBoard under ``run_dir/tensorboard`` plus the console, on the logging rank only."""
    if not enabled:
        return MultiLogger()
    keys = ("train/loss", "rollout/reward", "train/grad_norm", "train/ratio_mean", "train/clip_fraction")
    return MultiLogger(ConsoleLogger(keys), TensorBoardLogger(run_dir / "tensorboard"))
