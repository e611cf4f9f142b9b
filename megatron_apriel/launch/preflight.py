"""Every check that can run before a server, actor or trainer starts: a bad input fails here, with
the file and row, the key and the value to change. The local launch, its dry run and the SLURM
job's ``prepare`` step run the same checks."""

from __future__ import annotations

from pathlib import Path

from megatron_apriel.config import RunConfig
from megatron_apriel.launch.components import server_flags
from megatron_apriel.launch.progress import say


def prepare_base(run: RunConfig) -> None:
    """Build the tiny base model into ``model.hf_path`` when the config asks for one (once: reused)."""
    if not run.tiny_base.enabled:
        return
    from megatron_apriel.tiny.base import build_warm_base

    base = Path(run.model.hf_path)
    if not base.is_dir():
        say(f"building the tiny base model into {base} (tokenizer, {run.tiny_base.sft_steps} warm-start steps)")
    build_warm_base(base, run.tiny_base)


def preflight(run: RunConfig) -> None:
    """The checks, and the tiny base (not in a dry run: it checks what it can without building it)."""
    if run.model.hf_path and not run.tiny_base.enabled and not (Path(run.model.hf_path) / "config.json").is_file():
        raise ValueError(f"model.hf_path={run.model.hf_path} has no config.json: give a Hugging Face model directory.")
    if run.rollout.source != "fleet":
        return
    from megatron_apriel.data.datasets import training_pools

    server_flags(run)
    if not run.launch.dry_run:
        prepare_base(run)
    if not (run.launch.dry_run and _data_in_unbuilt_base(run)):
        training_pools(run.actor.data, run.actor.sampler.mix)  # bad rows, domains without problems


def _data_in_unbuilt_base(run: RunConfig) -> bool:
    """Whether a data file is one the tiny base writes when it is built (tiny_cpu's sums), and the
    base is not built yet: then a dry run cannot read the problems (the launch does, after building)."""
    if not run.tiny_base.enabled or Path(run.model.hf_path).is_dir():
        return False
    base = Path(run.model.hf_path).resolve()
    return any(Path(f).resolve().is_relative_to(base) for f in run.actor.data)
