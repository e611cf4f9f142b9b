"""``apriel-train``: the launcher of a whole run on one machine.

    apriel-train --config-name tiny_cpu                      # servers, actor and trainer ranks, all here
    apriel-train --config-name apriel_15b model.hf_path=... launch.dry_run=true

It composes the run once (preset, ``--config-dir``, overrides ``key=value``; default preset
tiny_cpu), writes the resolved config to ``run_dir/config.yaml`` and starts the components, which
read that file (``launch/``). Run again on the same run directory, it resumes that run from its
saved config (the preset is not read again); overrides on the command line change it. Any key
can be overridden (``optim.lr=1e-6 parallel.tp=2``).

Trainer ranks are ``python -m megatron_apriel.entrypoints.trainer_rank --run-dir RUN_DIR`` (under
torchrun or srun); on a cluster ``apriel-submit`` runs the whole job (``slurm/train.sbatch``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megatron_apriel.config import launch_config
from megatron_apriel.logs import setup_logging
from megatron_apriel.refusals import refusals, refuse

PROG = "apriel-train"
RANK_MOVED = ("trainer ranks no longer run this command: a launcher writes the run's config and starts the "
              "ranks as `python -m megatron_apriel.entrypoints.trainer_rank --run-dir RUN_DIR`; run the whole job "
              "with apriel-train, or apriel-submit on SLURM.")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other refusal
        refuse(PROG, f"{message}: apriel-train takes --config-name, --config-dir and key=value overrides "
                     "(launch.dry_run=true prints what the run would start)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--config-name", "-cn", default="tiny_cpu", help="a preset of megatron_apriel/conf or --config-dir")
    p.add_argument("--config-dir", "-cd", default=None, help="a directory of your own presets")
    p.add_argument("overrides", nargs="*", help="key=value (Hydra's override syntax)")
    return p


def main(argv: Optional[list[str]] = None) -> None:
    from megatron_apriel.parallel.launcher_env import trainer_rank_env

    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging()
    with refusals(PROG):
        if trainer_rank_env(os.environ) is not None:
            raise ValueError(RANK_MOVED)
        run, relaunch = launch_config(args.config_name, args.overrides, args.config_dir)
    from megatron_apriel.launch.local import launch

    if relaunch:
        print(f"{PROG}: {run.run_dir} holds a run: resuming it with its saved config"
              + (f" and {' '.join(args.overrides)}" if args.overrides else ""), flush=True)
    raise SystemExit(launch(run))


if __name__ == "__main__":
    main()
