"""``apriel-train``: the Hydra entry point of a whole run, and of each trainer rank.

One CPU machine, the tiny recipe (vLLM server, actor and 2 trainer ranks, all started here):
    apriel-train --config-name tiny_cpu
Under torchrun (RANK set) or srun (one task per rank, MASTER_ADDR/MASTER_PORT exported; SLURM's
task variables are mapped by ``parallel.launcher_env``), each rank runs the trainer directly; the
servers and the actor run elsewhere (``apriel-serve``, ``python -m megatron_apriel.entrypoints.actor``):
    torchrun --nproc_per_node 8 -m megatron_apriel.entrypoints.train --config-name apriel_15b model.hf_path=...
    MASTER_ADDR=node1 MASTER_PORT=29500 srun -N4 --ntasks-per-node 8 python -m megatron_apriel.entrypoints.train ...
(``slurm/train.sbatch`` and ``apriel-submit`` do the second for you.)
Any key can be overridden on the command line (``optim.lr=1e-6 parallel.tp=2``).

This module is the trainer's composition root: it builds the model stage, the optimizer, the
rollout source and the weight sender from the config and hands them to ``Trainer``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from megatron_apriel.config import RunConfig, hydra_entry, register_configs, to_run_config
from megatron_apriel.logs import setup_logging
from megatron_apriel.refusals import REFUSALS, refuse
from megatron_apriel.stop import STOP_FILE_ENV, StopFlag

log = logging.getLogger("megatron_apriel")
register_configs()


def _local_source(run: RunConfig, ctx, parts):
    from megatron_apriel.trainer.local_source import LocalRolloutSource

    return LocalRolloutSource(cfg=run.rollout, model=parts.chunks[0], ctx=ctx, vocab_size=parts.arch.vocab_size,
                              sampling=run.sampling, rewards=run.rewards)


def _stream_source(run: RunConfig, ctx, parts):
    from megatron_apriel.trainer.source import StreamSource

    return StreamSource(run.paths.rollouts, run.rollout, ctx, run.actor.sampler.mix,
                        moe_layers=parts.arch.moe_layers or None)


def _replay_source(run: RunConfig, ctx, parts):
    from megatron_apriel.rollout.stream import list_segments
    from megatron_apriel.trainer.source import StreamSource

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
    from megatron_apriel.rollout.fleet import registered, wait_for_fleet

    if run.fleet.servers:
        return list(run.fleet.servers)
    fleet_dir = run.paths.fleet
    wait_for_fleet(fleet_dir, run.fleet.num_servers, run.fleet.startup_timeout_s, give_up=lambda: stop.requested)
    return lambda: [(r.url, r.instance) for r in registered(fleet_dir)]


def build_sender(run: RunConfig, ctx, parts, stop: StopFlag):
    from megatron_apriel.convert.hf_io import HFReader
    from megatron_apriel.convert.mapping import detect_layout
    from megatron_apriel.weight_sync.sender import WeightSender
    from megatron_apriel.weight_sync.source import table_to_hf

    served = HFReader(run.model.hf_path)
    layout = detect_layout(served.files.keys(), served.config)  # the served checkpoint's own key layout
    members = fleet_members(run, stop) if ctx.rank == 0 else []
    return WeightSender(run.weight_sync, members=members, model=parts.chunks[0].module, ctx=ctx,
                        vocab_size=parts.arch.vocab_size, to_hf=table_to_hf(parts.arch, layout),
                        should_stop=lambda: stop.requested)


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
    return Trainer(run, ctx, parts, source, logger, sender, stop=stop)


def run_trainer(run: RunConfig, raw: DictConfig) -> None:
    from megatron_apriel._patches import shield_checkpoint_writer
    from megatron_apriel.parallel.groups import destroy_parallel, init_parallel

    # A stop signal during start-up (SLURM's may come any time) is remembered, not fatal.
    stop = StopFlag(os.environ.get(STOP_FILE_ENV))
    shield_checkpoint_writer()
    ctx = init_parallel(run.parallel, seed=run.seed)
    try:
        if ctx.rank == 0:
            Path(run.run_dir).mkdir(parents=True, exist_ok=True)
            run.paths.config.write_text(OmegaConf.to_yaml(raw))
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


PROG = "apriel-train"


def _main(cfg: DictConfig) -> None:
    from megatron_apriel.parallel.launcher_env import trainer_rank_env

    rank_env = trainer_rank_env(os.environ)
    if rank_env is not None:  # a trainer rank under torchrun / srun
        os.environ.update(rank_env)
    setup_logging()
    try:
        run = to_run_config(cfg)
    except REFUSALS as err:
        if rank_env is not None:
            raise  # a rank's log keeps the traceback
        refuse(PROG, err)
    if rank_env is not None:
        run_trainer(run, cfg)
        return
    from megatron_apriel.launch.local import launch

    raise SystemExit(launch(run, sys.argv[1:]))


def composition_arguments(argv: list[str]) -> Optional[tuple[str, list[str], Optional[str]]]:
    """``(config name, overrides, config dir)`` when ``argv`` holds only those (tiny_cpu when no
    name is given); None when it holds other Hydra flags or hydra.* overrides (Hydra handles those)."""
    name, config_dir, overrides, i = "tiny_cpu", None, [], 0
    while i < len(argv):
        a = argv[i]
        flag, eq, value = a.partition("=")
        if flag in ("--config-name", "-cn", "--config-dir", "-cd"):
            if not eq:
                if i + 1 >= len(argv):
                    return None
                value, i = argv[i + 1], i + 1
            if flag in ("--config-name", "-cn"):
                name = value
            else:
                config_dir = value
        elif a.startswith(("-", "hydra.", "+hydra.")):
            return None
        else:
            overrides.append(a)
        i += 1
    return name, overrides, config_dir


def main() -> None:
    from megatron_apriel.parallel.launcher_env import trainer_rank_env

    # Hydra's own refusals (no such preset, unknown key, bad value) as ours: one line, exit 2. A
    # trainer rank gets the arguments its launcher composed already: it does not compose them twice.
    args = composition_arguments(sys.argv[1:]) if trainer_rank_env(os.environ) is None else None
    if args is not None:
        from megatron_apriel.config import compose_config

        try:
            compose_config(*args)
        except ValueError as err:
            refuse(PROG, err)
    try:
        hydra_entry(_main)
    except ValueError as err:  # a domain mix override that does not parse (Hydra reports what _main raises)
        refuse(PROG, err)


if __name__ == "__main__":
    main()
