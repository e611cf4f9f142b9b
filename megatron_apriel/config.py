"""The run's typed configuration, composed from each component's own config dataclass.

The dataclasses are registered in Hydra's ConfigStore as the schema ``run_schema``; the YAML
presets in ``conf/`` hold overrides only. Hydra rejects unknown keys and ill-typed values (naming
the key); ``to_run_config`` then builds the dataclasses, whose ``__post_init__`` checks ranges and
says how to fix a bad value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from megatron_apriel.model.provider import ModelConfig
from megatron_apriel.model.wrap import OptimConfig
from megatron_apriel.parallel.dims import ParallelConfig
from megatron_apriel.rewards import RewardConfig
from megatron_apriel.rollout.local import LocalRolloutConfig
from megatron_apriel.trainer.checkpoint import CheckpointConfig
from megatron_apriel.trainer.loss import LossConfig

ROLLOUT_SOURCES = ("local",)


@dataclass
class TrainerConfig:
    steps: int = 250
    """Optimizer steps in the run (the paper: 250)."""
    seq_len: int = 20480
    """Longest prompt + completion in tokens; also the packed row length (16K output + prompt)."""
    packing: bool = True
    """Pack several sequences per row (THD). False: right-padded rows of micro_batch_size."""
    micro_batch_size: int = 1
    """Rows per micro-batch when packing is off."""
    log_every: int = 1

    def __post_init__(self) -> None:
        if min(self.steps, self.seq_len, self.micro_batch_size, self.log_every) < 1:
            raise ValueError("trainer.steps, seq_len, micro_batch_size and log_every must be >= 1.")


@dataclass
class RolloutConfig:
    source: str = "local"
    """Where rollouts come from. local: the trainer samples from its own model (toy reward, CPU
    runs and tests). The vLLM fleet source arrives with the actor."""
    local: LocalRolloutConfig = field(default_factory=LocalRolloutConfig)

    def __post_init__(self) -> None:
        if self.source not in ROLLOUT_SOURCES:
            raise ValueError(f"rollout.source={self.source!r} is not available; choose one of {ROLLOUT_SOURCES}.")


@dataclass
class LaunchConfig:
    nproc_per_node: int = 1
    """Trainer ranks started by ``apriel-train`` on this machine when not already under torchrun/srun."""
    master_port: int = 0
    """Rendezvous port for those ranks; 0 picks a free one (two runs on one machine never collide)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError("launch.nproc_per_node must be >= 1.")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"launch.master_port={self.master_port} is not a port; use 0 for a free one.")


@dataclass
class RunConfig:
    run_dir: str = "runs/default"
    """Everything the run writes goes here: config.yaml, tensorboard/, checkpoints/, rollouts/, hf/."""
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Validated dataclasses from a composed config (runs every ``__post_init__`` check)."""
    run = OmegaConf.to_object(cfg)
    if not isinstance(run, RunConfig):
        raise TypeError("the config was not composed on run_schema; start the YAML with `defaults: [run_schema, _self_]`.")
    return run
