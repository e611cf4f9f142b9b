"""``Trainer.run``: rollouts -> micro-batches -> GSPO step -> metrics -> checkpoint, each a named method."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from megatron_apriel.config import RunConfig
from megatron_apriel.metrics import build_logger
from megatron_apriel.model.provider import build_model
from megatron_apriel.model.wrap import build_optimizer, wrap_model
from megatron_apriel.parallel.collectives import any_rank
from megatron_apriel.parallel.groups import ParallelContext
from megatron_apriel.rollout.local import LocalRolloutSource
from megatron_apriel.trainer.batch import MicroBatch, TrainSample, packed_microbatches, padded_microbatches
from megatron_apriel.trainer.checkpoint import latest_checkpoint, load_checkpoint, load_model_weights, save_checkpoint
from megatron_apriel.trainer.step import train_step

log = logging.getLogger("megatron_apriel")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # SLURM: scancel / --signal=USR1@<seconds>


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: ParallelContext):
        self.cfg, self.ctx = cfg, ctx
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.arch = cfg.model.resolve_arch()
        self.model = build_model(cfg.model, ctx)
        self.chunks = wrap_model(self.model, ctx)
        self.optimizer, self.scheduler = build_optimizer(self.chunks, cfg.optim, ctx, total_steps=cfg.trainer.steps)
        self.source = self._build_source()
        self.logger = build_logger(self.run_dir, enabled=ctx.is_logging_rank)
        self.step = 0
        self.stop_requested = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._request_stop)
        self.restore()

    def _build_source(self):
        return LocalRolloutSource(self.cfg.rollout.local, self.chunks[0], self.ctx, self.arch.vocab_size,
                                  self.cfg.loss.temperature, self.cfg.rewards)

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True  # acted on at the end of the current step, on every rank at once

    def restore(self) -> None:
        """Resume from the newest complete checkpoint, else load initial weights if configured."""
        latest = latest_checkpoint(self.ckpt_root) if self.cfg.checkpoint.resume else None
        if latest is not None:
            state = load_checkpoint(latest, self.chunks, self.optimizer, self.scheduler, self.ctx)
            self.step = state["step"]
            self.source.load_state_dict(state["source"])
            log.info("resumed from %s at step %d", latest, self.step)
        elif self.cfg.checkpoint.load:
            load_model_weights(self.cfg.checkpoint.load, self.chunks)
            log.info("initial weights from %s", self.cfg.checkpoint.load)

    def save(self) -> None:
        path = save_checkpoint(self.ckpt_root, self.step, self.chunks, self.optimizer, self.scheduler, self.ctx,
                               {"source": self.source.state_dict()}, self.arch, keep_last=self.cfg.checkpoint.keep_last)
        log.info("saved %s", path)

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
        """Train until ``trainer.steps`` or a stop signal; returns this run's per-step metrics."""
        history, every = [], self.cfg.checkpoint.save_every
        if self.step >= self.cfg.trainer.steps:
            log.warning("%s already holds step %d of %d: nothing to do. Raise trainer.steps to continue or "
                        "choose a new run_dir.", self.ckpt_root, self.step, self.cfg.trainer.steps)
        while self.step < self.cfg.trainer.steps:
            samples, rollout_metrics = self.source.next_batch(self.step)
            metrics = {**rollout_metrics, **self.train_once(samples)}
            if self.step % self.cfg.trainer.log_every == 0:
                self.logger.log(metrics, self.step)
            history.append(metrics)
            self.step += 1
            stop = any_rank(self.stop_requested)
            if stop or (every and self.step % every == 0) or (
                    self.step == self.cfg.trainer.steps and self.cfg.checkpoint.save_at_end):
                self.save()
            if stop:
                log.warning("stop signal received: saved step %d and stopping", self.step)
                break
        self.logger.close()
        return history
