"""A trainer rank: one process of the trainer, under torchrun or srun, on a run directory that
its launcher prepared (``run_dir/config.yaml``, written by ``apriel-train`` or the SLURM job's
prepare step):

    torchrun --nproc_per_node 8 -m megatron_apriel.entrypoints.trainer_rank --run-dir /shared/runs/x
    MASTER_ADDR=node1 MASTER_PORT=29500 srun -N4 --ntasks-per-node 8 \
        python -m megatron_apriel.entrypoints.trainer_rank --run-dir /shared/runs/x

SLURM's task variables are mapped to torchrun's by ``parallel.launcher_env``. ``apriel-train``
and ``slurm/train.sbatch`` start the ranks for you; the servers and the actor run beside them.

This module is the trainer's composition root: it builds the model stage, the optimizer, the
rollout source and the weight sender from the run's config and hands them, with the trainer's own
settings, to ``Trainer``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path
from typing import Optional

from megatron_apriel.config import RunConfig, load_run_config
from megatron_apriel.logs import setup_logging
from megatron_apriel.slurm.layout import ONE_NODE_ENV, job_node_address, one_node_split
from megatron_apriel.stop import STOP_FILE_ENV, StopFlag

log = logging.getLogger("megatron_apriel")


def _local_source(run: RunConfig, ctx, parts):
    from megatron_apriel.trainer.local_source import LocalRolloutSource

    return LocalRolloutSource(cfg=run.rollout, model=parts.chunks[0], ctx=ctx, vocab_size=parts.arch.vocab_size,
                              sampling=run.sampling, rewards=run.rewards)


def _stream_source(run: RunConfig, ctx, parts):
    from megatron_apriel.trainer.stream_source import StreamSource

    return StreamSource(run.paths.rollouts, run.rollout, ctx, run.actor.sampler.mix,
                        moe_layers=parts.arch.moe_layers or None)


def _replay_source(run: RunConfig, ctx, parts):
    from megatron_apriel.records.stream import list_segments
    from megatron_apriel.trainer.stream_source import StreamSource

    if not list_segments(Path(run.rollout.replay_from)):
        raise ValueError(f"rollout.replay_from={run.rollout.replay_from} holds no rollout segments: give an earlier "
                         "run's rollouts/ directory.")
    return StreamSource(run.rollout.replay_from, run.rollout, ctx, run.actor.sampler.mix, replay=True,
                        moe_layers=parts.arch.moe_layers or None)


ROLLOUT_SOURCES = {"local": _local_source, "fleet": _stream_source, "replay": _replay_source}
"""``rollout.source`` (one of `megatron_apriel.choices.RolloutSource`, checked by a test) -> builder of the
trainer's `RolloutSource`."""


def fleet_members(run: RunConfig, stop: StopFlag):
    """The fleet as the weight sender sees it: fixed URLs, or the run directory's registrations
    (waited for, unless a stop is requested: the first push then ends the run on every rank)."""
    from megatron_apriel.fleet.registry import registered, wait_for_fleet

    if run.fleet.servers:
        return list(run.fleet.servers)
    fleet_dir = run.paths.fleet
    wait_for_fleet(fleet_dir, run.fleet.num_servers, run.fleet.startup_timeout_s, give_up=lambda: stop.requested)
    return lambda: [(r.url, r.instance) for r in registered(fleet_dir)]


def build_sender(run: RunConfig, ctx, parts, stop: StopFlag):
    from megatron_apriel.convert.hf_io import HFReader
    from megatron_apriel.convert.mapping import detect_layout
    from megatron_apriel.weight_sync.gather import table_to_hf
    from megatron_apriel.weight_sync.sender import WeightSender

    cfg = run.weight_sync
    if cfg.advertise_host is None and (addr := job_node_address(os.environ)):  # what the job's servers reach
        cfg = dataclasses.replace(cfg, advertise_host=addr)
    served = HFReader(run.model.hf_path)
    layout = detect_layout(served.files.keys(), served.config)  # the served checkpoint's own key layout
    members = fleet_members(run, stop) if ctx.rank == 0 else []
    return WeightSender(cfg, members=members, model=parts.chunks[0].module, ctx=ctx,
                        vocab_size=parts.arch.vocab_size, to_hf=table_to_hf(parts.arch, layout),
                        should_stop=lambda: stop.requested, keep_kv=run.fleet.kv_on_update == "keep")


def build_trainer(run: RunConfig, ctx, stop: Optional[StopFlag] = None):
    """``stop``: the rank's stop requests (``run_trainer`` makes it first thing); None: made here."""
    from megatron_apriel.metrics import build_logger
    from megatron_apriel.model.provider import build_model
    from megatron_apriel.model.wrap import build_optimizer, wrap_model
    from megatron_apriel.trainer.trainer import ModelParts, Trainer

    stop = stop if stop is not None else StopFlag()
    arch = run.model.resolve_arch()
    arch.check_sequence_length(run.trainer.seq_len)  # a sliding window must cover the whole sequence
    chunks = wrap_model(build_model(run.model, ctx), ctx)
    optimizer, scheduler = build_optimizer(chunks, run.optim, ctx, total_steps=run.trainer.steps)
    routing = None
    if arch.is_moe:
        from megatron_apriel.model.routing import StageRouting

        routing = StageRouting(chunks[0].module, moe_layers=arch.moe_layers, num_experts=arch.num_experts,
                               replay=run.rollout.routing_replay)
    parts = ModelParts(arch, chunks, optimizer, scheduler, routing)
    source = ROLLOUT_SOURCES[run.rollout.source](run, ctx, parts)
    sender = build_sender(run, ctx, parts, stop) if run.rollout.source == "fleet" else None
    logger = build_logger(Path(run.run_dir), enabled=ctx.is_logging_rank)
    gate = None
    if run.fleet.drift_gate.enabled and run.rollout.source == "fleet":
        from megatron_apriel.trainer.drift_gate import FleetGate

        gate = FleetGate(run.fleet.drift_gate, run.paths.fleet, ctx.is_logging_rank)
    return Trainer(trainer=run.trainer, loss=run.loss, checkpoint=run.checkpoint, checkpoints=run.paths.checkpoints,
                   init_hf=run.model.hf_path, ctx=ctx, parts=parts, source=source, logger=logger, sender=sender,
                   stop=stop, gate=gate)


def run_trainer(run: RunConfig) -> None:
    from megatron_apriel._patches import shield_checkpoint_writer
    from megatron_apriel.parallel.groups import destroy_parallel, init_parallel

    # A stop signal during start-up (SLURM's may come any time) is remembered, not fatal.
    stop = StopFlag(os.environ.get(STOP_FILE_ENV))
    shield_checkpoint_writer()
    ctx = init_parallel(run.parallel, seed=run.seed)
    try:
        trainer = build_trainer(run, ctx, stop)
        if stop.requested:
            log.warning("stop request (%s) during start-up: the trainer stops at once", stop.reason())
        try:
            history = trainer.run()
        finally:
            trainer.close()
        if ctx.is_logging_rank and history:
            log.info("done: %d steps, final reward %.4f", len(history), history[-1].get("rollout/reward", float("nan")))
    finally:
        destroy_parallel()


def main(argv: Optional[list[str]] = None) -> None:
    from megatron_apriel.parallel.launcher_env import trainer_rank_env

    p = argparse.ArgumentParser(prog="python -m megatron_apriel.entrypoints.trainer_rank",
                                description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True, help="the run directory its launcher prepared")
    args = p.parse_args(argv)
    rank_env = trainer_rank_env(os.environ)
    if rank_env is None:
        raise SystemExit(f"{p.prog}: error: not a trainer rank (no RANK, no srun step of several tasks): start it "
                         "under torchrun or srun, or run the whole job with apriel-train.")
    os.environ.update(rank_env)
    setup_logging()
    run = load_run_config(args.run_dir)
    if os.environ.get(ONE_NODE_ENV) == "1":  # a SLURM node shared with the fleet: our GPUs, before CUDA starts
        os.environ["CUDA_VISIBLE_DEVICES"] = one_node_split(run, os.environ.get("CUDA_VISIBLE_DEVICES")).trainer
        log.info("one node shared with the fleet: the trainer's ranks on GPUs %s", os.environ["CUDA_VISIBLE_DEVICES"])
    run_trainer(run)  # a rank's log keeps a refusal's traceback


if __name__ == "__main__":
    main()
