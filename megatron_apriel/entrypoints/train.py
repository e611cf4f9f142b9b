"""``apriel-train``: the Hydra entry point of a whole run.

One CPU machine, the tiny default (starts its own 2 trainer ranks):
    apriel-train --config-name tiny_cpu
Under torchrun or srun (RANK/WORLD_SIZE set), each rank runs the trainer directly:
    torchrun --nproc_per_node 8 -m megatron_apriel.entrypoints.train --config-name apriel_15b model.hf_path=...
Any key can be overridden on the command line (``optim.lr=1e-6 parallel.tp=2``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from megatron_apriel.config import RunConfig, register_configs, to_run_config
from megatron_apriel.parallel.rendezvous import free_port

log = logging.getLogger("megatron_apriel")
register_configs()


def _relaunch(run: RunConfig) -> int:
    """Start ``launch.nproc_per_node`` ranks of this same command under torch.distributed.run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(run.launch.nproc_per_node),
           "--master_port", str(run.launch.master_port or free_port()), "-m", "megatron_apriel.entrypoints.train",
           *sys.argv[1:], f"run_dir={run.run_dir}"]
    log.info("launching %d trainer ranks: %s", run.launch.nproc_per_node, " ".join(cmd))
    return subprocess.run(cmd, check=False).returncode


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # Megatron logs every config at INFO
    # Expected on CPU: Megatron announces each torch fallback for the absent Apex/TE kernels.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def run_trainer(run: RunConfig, raw: DictConfig) -> None:
    from megatron_apriel.parallel.groups import destroy_parallel, init_parallel
    from megatron_apriel.trainer.trainer import Trainer

    ctx = init_parallel(run.parallel, seed=run.seed)
    try:
        if ctx.rank == 0:
            Path(run.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run.run_dir) / "config.yaml").write_text(OmegaConf.to_yaml(raw))
        history = Trainer(run, ctx).run()
        if ctx.is_logging_rank and history:
            log.info("done: %d steps, final reward %.4f", len(history), history[-1].get("rollout/reward", float("nan")))
    finally:
        destroy_parallel()


@hydra.main(config_path="../conf", config_name="tiny_cpu", version_base=None)
def _main(cfg: DictConfig) -> None:
    _setup_logging()
    run = to_run_config(cfg)
    under_launcher = "RANK" in os.environ
    if not under_launcher and run.launch.nproc_per_node > 1:
        sys.exit(_relaunch(run))
    if not under_launcher:  # a single rank without a launcher: be our own rendezvous
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(run.launch.master_port or free_port()))
    run_trainer(run, cfg)


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
