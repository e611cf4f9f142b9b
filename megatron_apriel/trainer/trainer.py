"""``Trainer.run``: rollouts -> GSPO step -> weights to the fleet -> metrics -> checkpoint.

The trainer receives its collaborators from the entry point (``entrypoints/trainer_rank.py``, the
composition root) with its own settings (``trainer.*``, ``loss.*``, ``checkpoint.*``), never the
whole run's, and never picks a concrete one itself: the model stage and its optimizer, a
`RolloutSource` (the stream the actor writes, or the local self-sampling source), an optional
weight sender (the vLLM fleet) and a metric logger.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_apriel.metrics import MetricLogger
from megatron_apriel.model.arch import ModelArch
from megatron_apriel.model.routing import StageRouting
from megatron_apriel.parallel.collectives import any_rank
from megatron_apriel.parallel.dims import cp_alignment
from megatron_apriel.parallel.groups import ParallelContext
from megatron_apriel.records.samples import TrainSample
from megatron_apriel.stop import STOP_COST_FILE, StopFlag, StopRequested
from megatron_apriel.trainer.batch import MicroBatch, cp_shard, packed_microbatches, padded_microbatches
from megatron_apriel.trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_hf_weights,
    load_model_weights,
    save_checkpoint,
    step_dir,
)
from megatron_apriel.trainer.config import CheckpointConfig, LossConfig, TrainerConfig
from megatron_apriel.trainer.drift_gate import DriftGateError, FleetGate
from megatron_apriel.trainer.step import NonFiniteError, train_step
from megatron_apriel.trainer.stream_source import RolloutSource

log = logging.getLogger("megatron_apriel")


@dataclass
class ModelParts:
    """One model stage as built by the entry point: Megatron DDP chunks, optimizer, LR schedule,
    and for a mixture of experts the stage's routing taps (replay, load and mismatch counts)."""

    arch: ModelArch
    chunks: list
    optimizer: object
    scheduler: object
    routing: Optional[StageRouting] = None


class Trainer:
    def __init__(self, *, trainer: TrainerConfig, loss: LossConfig, checkpoint: CheckpointConfig,
                 checkpoints: Path, init_hf: Optional[str], ctx: ParallelContext, parts: ModelParts,
                 source: RolloutSource, logger: MetricLogger, sender=None, stop: Optional[StopFlag] = None,
                 gate: Optional[FleetGate] = None):
        """``checkpoints``: the run's checkpoint directory. ``init_hf``: the Hugging Face model the
        weights start from when there is no checkpoint to resume and no ``checkpoint.load`` (the one
        the fleet serves). ``sender``: a `WeightSender` for the vLLM fleet, or None (the local source
        needs none). ``stop``: the rank's stop requests (signals, stop file); None installs the
        signal handlers here. ``gate``: the drift gate (``fleet.drift_gate``), or None."""
        self.t, self.loss_cfg, self.ckpt, self.init_hf, self.ctx = trainer, loss, checkpoint, init_hf, ctx
        self.arch, self.chunks, self.routing = parts.arch, parts.chunks, parts.routing
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.source, self.logger, self.sender, self.gate = source, logger, sender, gate
        self.gate_stop: Optional[str] = None
        """Why the drift gate stops the run (every server tripped), once it does."""
        self.ckpt_root = Path(checkpoints)
        self.step = 0
        self.stop = stop if stop is not None else StopFlag()
        self._step_s = self._save_s = 0.0
        self.restore()

    def stopping(self) -> bool:
        """Collective: True on every rank if any rank has a stop request."""
        return any_rank(self.stop.requested)

    def restore(self) -> None:
        """Resume from the newest complete checkpoint, else initial weights: ``checkpoint.load`` (a
        Megatron checkpoint), else the Hugging Face model of ``model.hf_path`` (the one the fleet
        serves), else the random init of an inline ``model.arch``."""
        latest = latest_checkpoint(self.ckpt_root) if self.ckpt.resume else None
        if latest is not None:
            state = load_checkpoint(latest, chunks=self.chunks, optimizer=self.optimizer, scheduler=self.scheduler,
                                    ctx=self.ctx)
            self.step = state["step"]
            self.source.load_state_dict(state["source"])
            if self.gate is not None:  # a checkpoint saved before the gate's state was kept has none
                self.gate.load_state_dict(state.get("gate", {}))
            log.info("resumed from %s at step %d", latest, self.step)
        elif self.ckpt.load:
            load_model_weights(self.ckpt.load, self.chunks)
            log.info("initial weights from %s", self.ckpt.load)
        elif self.init_hf:
            load_hf_weights(self.init_hf, self.chunks, self.arch, self.ctx)
            log.info("initial weights from %s", self.init_hf)

    def save(self) -> None:
        t0 = time.perf_counter()
        extra = {"source": self.source.state_dict()}
        if self.gate is not None:
            extra["gate"] = self.gate.state_dict()
        path = save_checkpoint(self.ckpt_root, self.step, chunks=self.chunks, optimizer=self.optimizer,
                               scheduler=self.scheduler, ctx=self.ctx, extra=extra, arch=self.arch,
                               keep_last=self.ckpt.keep_last)
        self._save_s = time.perf_counter() - t0
        log.info("saved %s in %.1fs", path, self._save_s)
        self._write_stop_cost(path)

    def _write_stop_cost(self, path: Path) -> None:
        """What a stop takes (the slowest step so far plus this save, with margin), for the job script."""
        if self.ctx.rank == 0:
            seconds = int(1.5 * (self._step_s + self._save_s)) + 5
            (path / f"{STOP_COST_FILE}.tmp").write_text(f"{seconds}\n")
            (path / f"{STOP_COST_FILE}.tmp").rename(path / STOP_COST_FILE)

    def microbatches(self, samples: list[TrainSample]) -> list[MicroBatch]:
        t = self.t
        ids = list(range(len(samples)))
        if t.packing:
            dims = self.ctx.dims
            align = cp_alignment(dims.cp, dims.tp, self.ctx.sequence_parallel)
            return [cp_shard(mb, dims.cp, self.ctx.cp_rank)
                    for mb in packed_microbatches(samples, ids, t.seq_len, align=align)]
        return padded_microbatches(samples, ids, t.micro_batch_size, t.seq_len)

    def train_once(self, samples: list[TrainSample]) -> dict[str, float]:
        mbs = self.microbatches(samples)
        try:
            return train_step(self.chunks, mbs, optimizer=self.optimizer, scheduler=self.scheduler, ctx=self.ctx,
                              cfg=self.loss_cfg, vocab_size=self.arch.vocab_size, routing=self.routing,
                              logprob_chunk_tokens=self.t.logprob_chunk_tokens)
        except NonFiniteError as err:
            where = err.microbatches or range(len(mbs))
            groups = sorted({samples[i].group for m in where for i in mbs[m].sample_ids})
            latest = latest_checkpoint(self.ckpt_root)
            raise NonFiniteError(
                f"{err.what} at step {self.step} (this rank's micro-batch(es) {err.microbatches or 'all'}, "
                f"group(s) {groups}); the step was not applied and nothing was saved after "
                f"{latest or 'the start'}. Inspect those groups in run_dir/rollouts, lower optim.lr or "
                f"optim.clip_grad, then rerun the same command to resume from that checkpoint", []) from err

    def sync_weights(self) -> dict[str, float]:
        """Send the current weights (version = steps taken) to the fleet, in flight; tell the source."""
        if self.sender is None:
            return {}
        report = self.sender.push(self.step)
        self.source.weights_updated(self.step)
        if not report.accepted:
            log.warning("weight update %d rejected by %s; they keep serving older weights", self.step, report.rejected)
        m = {"sync/total_s": report.total_s, "sync/send_s": report.send_s, "sync/pause_s": report.pause_s,
             "sync/MB": report.nbytes / 1e6, "sync/accepted": float(report.accepted),
             "sync/reconnects": float(self.sender.reconnects)}
        if report.fleet is not None:  # vLLM's counters since the previous update (docs/serving.md)
            m.update({"sync/preempted": float(report.fleet.preempted),
                      "sync/prompt_tokens": float(report.fleet.prompt_tokens),
                      "sync/gen_tokens_per_s": report.fleet.generation_tokens / max(report.fleet.seconds, 1e-9)})
        return m

    def _idle(self) -> None:
        """Every rank together, between polls for rollouts: a stop request is acted on now (the
        actor may be gone, so the step may never fill), then the fleet is kept current."""
        if self.stopping():
            raise StopRequested
        self.keep_fleet_current()

    def keep_fleet_current(self) -> None:
        """While waiting for rollouts: a server that restarted gets the current weights now, not
        after the step (the actor sends it nothing before, and the step may need its rollouts)."""
        if self.sender is not None and self.sender.refresh() is not None:
            log.warning("fleet changed while waiting for rollouts: sent it the weights of version %d", self.step)

    def _checkpoint_due(self, stop: bool) -> bool:
        every, last = self.ckpt.save_every, self.step == self.t.steps
        return stop or bool(every and self.step % every == 0) or (last and self.ckpt.save_at_end)

    def run(self) -> list[dict[str, float]]:
        """Train until ``trainer.steps`` or a stop request; returns this run's per-step metrics.

        A stop request is acted on by every rank together at the first of: the start of a step,
        the wait for a step's rollouts (that step is not trained), the end of the step in progress
        (saved before its weights would go to the fleet, which may be stopping too), a wait for
        the fleet. A save in progress completes. The newest trained step is saved, then ``run``
        returns.
        """
        history: list[dict[str, float]] = []
        try:
            if self.step >= self.t.steps:
                log.warning("%s already holds step %d of %d: nothing to do. Raise trainer.steps to continue or "
                            "choose a new run_dir.", self.ckpt_root, self.step, self.t.steps)
            elif not self.stopping():
                self.sync_weights()  # the fleet serves this step's weights before a rollout is trained on
            while self.step < self.t.steps:
                if self.stopping():
                    raise StopRequested
                metrics, stop = self._step()
                history.append(metrics)
                if stop:
                    if self.gate_stop is None:  # the gate's reason is raised below
                        log.warning("stop request (%s): saved step %d and stopping", self.stop.reason(), self.step)
                    break
        except StopRequested:
            self._stop_between_steps()
        self.logger.close()
        if self.gate_stop is not None:
            raise DriftGateError(self.gate_stop)
        return history

    def _step(self) -> tuple[dict[str, float], bool]:
        """One step: rollouts, train, weights to the fleet, metrics, checkpoint. (metrics, stop)."""
        t0 = time.perf_counter()
        samples, metrics = self.source.next_batch(self.step, idle=self._idle)
        t1 = time.perf_counter()
        metrics.update(self.train_once(samples))
        if self.gate is not None:  # before the weights go out: a tripped server gets none
            gate_metrics, self.gate_stop = self.gate.after_step(metrics, self.step, self.source)
            metrics.update(gate_metrics)
        t2 = time.perf_counter()
        self._step_s = max(self._step_s, t2 - t1)
        self.step += 1
        stop = self.stopping() or self.gate_stop is not None
        if not stop:
            try:
                metrics.update(self.sync_weights())
            except StopRequested:  # the fleet went away while a stop was requested
                stop = True
        metrics.update({"time/wait_rollouts_s": t1 - t0, "time/train_s": t2 - t1,
                        "time/step_s": time.perf_counter() - t0})
        if (self.step - 1) % self.t.log_every == 0:
            self.logger.log(metrics, self.step - 1)
        if self._checkpoint_due(stop):
            self.save()
        return metrics, stop

    def _stop_between_steps(self) -> None:
        """The last completed step is saved (unless it already is); the next step is not trained,
        and its groups are read again on resume (the source's state is that of the last step)."""
        latest = latest_checkpoint(self.ckpt_root)
        if self.step > 0 and latest != step_dir(self.ckpt_root, self.step):
            self.save()
        log.warning("stop request (%s) before step %d: %s and stopping", self.stop.reason(), self.step,
                    f"saved step {self.step}" if self.step > 0 else "nothing trained yet, nothing saved")

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
