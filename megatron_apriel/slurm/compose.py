"""The run's config composed the way ``apriel-train`` composes it (same presets, overrides and
checks), for tools that are not Hydra entry points themselves (apriel-submit, the job's steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from omegaconf import DictConfig


def compose_run(config_name: str, overrides: list[str], config_dir: Optional[str] = None):
    """``(RunConfig, DictConfig)`` for ``--config-name config_name overrides...``; ``config_dir``
    adds a directory of the user's own presets (Hydra's ``--config-dir``)."""
    from hydra import compose, initialize_config_module

    from megatron_apriel.config import register_configs, to_run_config

    register_configs()
    extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else []
    with initialize_config_module(config_module="megatron_apriel.conf", version_base=None):
        cfg: DictConfig = compose(config_name=config_name, overrides=[*overrides, *extra])
    return to_run_config(cfg), cfg
