"""``Trainer.run``: rollouts -> micro-batches -> GSPO step -> metrics, every step a named method."""

from __future__ import annotations

from pathlib import Path

from megatron_apriel.config import RunConfig
from megatron_apriel.metrics import build_logger
from megatron_apriel.model.provider import build_model
from megatron_apriel.model.wrap import build_optimizer, wrap_model
from megatron_apriel.parallel.groups import ParallelContext
from megatron_apriel.rollout.local import LocalRolloutSource
from megatron_apriel.trainer.batch import MicroBatch, TrainSample, packed_microbatches, padded_microbatches
from megatron_apriel.trainer.step import train_step


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: ParallelContext):
        self.cfg, self.ctx = cfg, ctx
        self.run_dir = Path(cfg.run_dir)
        self.arch = cfg.model.resolve_arch()
        self.model = build_model(cfg.model, ctx)
        self.chunks = wrap_model(self.model, ctx)
        self.optimizer, self.scheduler = build_optimizer(self.chunks, cfg.optim, ctx, total_steps=cfg.trainer.steps)
        self.source = self._build_source()
        self.logger = build_logger(self.run_dir, enabled=ctx.is_logging_rank)
        self.step = 0

    def _build_source(self):
        return LocalRolloutSource(self.cfg.rollout.local, self.chunks[0], self.ctx, self.arch.vocab_size,
                                  self.cfg.loss.temperature, self.cfg.rewards)

    def microbatches(self, samples: list[TrainSample]) -> list[MicroBatch]:
        t = self.cfg.trainer
        ids = list(range(len(samples)))
        if t.packing:
            return packed_microbatches(samples, ids, t.seq_len)
        return padded_microbatches(samples, ids, t.micro_batch_size, t.seq_len)

    def train_once(self, samples: list[TrainSample]) -> dict[str, float]:
        return train_step(self.chunks, self.optimizer, self.scheduler, self.microbatches(samples), self.ctx,
                          self.cfg.loss, self.arch.vocab_size)

    def run(self) -> list[dict[str, float]]:
        """Train ``trainer.steps`` steps; returns the logged metrics of every step (logging rank)."""
        history = []
        while self.step < self.cfg.trainer.steps:
            samples, rollout_metrics = self.source.next_batch(self.step)
            metrics = {**rollout_metrics, **self.train_once(samples)}
            if self.step % self.cfg.trainer.log_every == 0:
                self.logger.log(metrics, self.step)
            history.append(metrics)
            self.step += 1
        self.logger.close()
        return history
