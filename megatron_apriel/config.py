"""The run's typed configuration, composed from each component's own config dataclass.

The dataclasses are registered in Hydra's ConfigStore as the schema ``run_schema``; the YAML
presets in ``conf/`` hold overrides only. Hydra rejects unknown keys and ill-typed values (naming
the key); ``to_run_config`` then builds the dataclasses, whose ``__post_init__`` checks ranges and
says how to fix a bad value. ``RunConfig`` checks what spans components: one output budget
(``rewards.max_len`` is vLLM's ``max_tokens``; ``trainer.seq_len`` must hold the longest prompt
plus it) and one temperature (``loss.temperature`` is also the sampling temperature).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from megatron_apriel.model.config import ModelConfig, OptimConfig
from megatron_apriel.parallel.dims import ParallelConfig
from megatron_apriel.rewards import RewardConfig
from megatron_apriel.rollout.config import ActorConfig, FleetConfig, RolloutConfig, SamplingConfig
from megatron_apriel.slurm.config import SlurmConfig
from megatron_apriel.tiny.config import TinyBaseConfig
from megatron_apriel.trainer.config import CheckpointConfig, LossConfig, TrainerConfig
from megatron_apriel.weight_sync.config import WeightSyncConfig


@dataclass(kw_only=True)
class LaunchConfig:
    nnodes: int = 1
    """Trainer nodes. ``apriel-train`` launches one machine; more run under srun/torchrun on each node."""
    nproc_per_node: int = 1
    """Trainer ranks per node (on this machine: started by ``apriel-train`` when not under torchrun/srun)."""
    master_port: int = 0
    """Rendezvous port for those ranks; 0: torchrun binds a free one as it starts (``--standalone``),
    so two runs on one machine never collide."""
    dry_run: bool = False
    """Print the processes, ranks and resources the run would start, then exit."""
    export_hf: bool = True
    """Convert the final checkpoint into run_dir/hf/ (loadable by transformers, servable by apriel-serve)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError("launch.nnodes and launch.nproc_per_node must be >= 1.")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"launch.master_port={self.master_port} is not a port; use 0 for a free one.")


@dataclass(kw_only=True)
class RunConfig:
    run_dir: str = "runs/default"
    """Everything the run writes goes here: config.yaml, tensorboard/, checkpoints/, rollouts/, hf/, logs/."""
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    tiny_base: TinyBaseConfig = field(default_factory=TinyBaseConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """Where apriel-submit runs the config on a SLURM cluster (ignored by apriel-train)."""

    def __post_init__(self) -> None:
        if self.tiny_base.enabled and self.model.hf_path is not None:
            base = Path(self.run_dir).resolve() / "base"
            if Path(self.model.hf_path).resolve() != base:
                raise ValueError(f"tiny_base.enabled builds the model into {base}, but model.hf_path="
                                 f"{self.model.hf_path}: leave model.hf_path unset or turn tiny_base off.")
        budget = self.rewards.max_len
        if self.rollout.source == "local":
            need, what = self.rollout.local.prompt_len + budget, f"rollout.local.prompt_len={self.rollout.local.prompt_len}"
        else:
            need, what = self.actor.max_prompt_tokens + budget, f"actor.max_prompt_tokens={self.actor.max_prompt_tokens}"
        if self.trainer.seq_len < need:
            raise ValueError(f"trainer.seq_len={self.trainer.seq_len} cannot hold a prompt of {what} plus the output "
                             f"budget rewards.max_len={budget}: set trainer.seq_len>={need} or lower one of them.")
        if self.parallel.sequence_parallel and self.trainer.seq_len % self.parallel.tp:
            raise ValueError(f"parallel.sequence_parallel=true splits every row's {self.trainer.seq_len} positions over "
                             f"parallel.tp={self.parallel.tp} ranks: set trainer.seq_len to a multiple of "
                             f"{self.parallel.tp}.")
        if self.rollout.source == "fleet" and not (self.model.hf_path or self.tiny_base.enabled):
            raise ValueError("rollout.source=fleet serves model.hf_path with vLLM: set model.hf_path to a Hugging "
                             "Face model directory.")

    @property
    def sampling(self) -> SamplingConfig:
        """How the run's rollouts are sampled, one setting each for the whole run: the budget
        (``rewards.max_len``), the temperature (``loss.temperature``, which the loss divides the
        logits by too), ``actor.top_p`` and ``actor.stop``. The actor and the local source use it."""
        return SamplingConfig(max_tokens=self.rewards.max_len, temperature=self.loss.temperature,
                              top_p=self.actor.top_p, stop=tuple(self.actor.stop))

    def resolved(self) -> RunConfig:
        """A copy with what every process of the run must read alike made explicit: ``run_dir``
        absolute (children may start elsewhere) and, with ``tiny_base.enabled``, ``model.hf_path``
        pointing at the base built in ``run_dir/base``."""
        run_dir = Path(self.run_dir).resolve()
        model = replace(self.model, hf_path=str(run_dir / "base")) if self.tiny_base.enabled else self.model
        return replace(self, run_dir=str(run_dir), model=model)


def register_configs() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Validated, resolved dataclasses from a composed config (runs every ``__post_init__`` check)."""
    run = OmegaConf.to_object(cfg)
    if not isinstance(run, RunConfig):
        raise TypeError("the config was not composed on run_schema; start the YAML with `defaults: [run_schema, _self_]`.")
    return run.resolved()


def hydra_error(err: Exception) -> str:
    """Hydra's or OmegaConf's composition error as one line: what it and its cause say about the
    key or preset (the ``full_key``/type lines, the search path and the stack-trace hint dropped)."""
    from hydra.errors import MissingConfigException

    noise = ("full_key:", "reference_type=", "object_type=", "Set the environment variable HYDRA_FULL_ERROR",
             "Config search path", "provider=", "Check that it's in your config search path")
    text = str(err) + ("\n" + str(err.__cause__) if err.__cause__ is not None else "")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(noise)]
    message = "; ".join(dict.fromkeys(line.rstrip(".") for line in lines))
    if getattr(err, "override", None):  # a parse error: say which argument
        message = f"override {err.override!r}: {message}"
    if isinstance(err, MissingConfigException):
        presets = sorted(p.stem for p in (Path(__file__).parent / "conf").glob("*.yaml"))
        message += f" (presets: {', '.join(presets)}; or add --config-dir DIR with your own)"
    return message


def compose_config(config_name: str, overrides: list[str], config_dir: Optional[str] = None) -> DictConfig:
    """The config of ``--config-name config_name overrides...`` as ``apriel-train`` composes it;
    ``config_dir`` adds a directory of the user's own presets (Hydra's ``--config-dir``). A preset
    that does not exist, an unknown key or an ill-typed value raises ``ValueError`` (one line)."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else []
    try:
        with initialize_config_module(config_module="megatron_apriel.conf", version_base=None):
            return compose(config_name=config_name, overrides=[*overrides, *extra])
    except (HydraException, OmegaConfBaseException) as err:
        raise ValueError(hydra_error(err)) from err


def compose_run(config_name: str, overrides: list[str], config_dir: Optional[str] = None) -> tuple[RunConfig, DictConfig]:
    """``(RunConfig, DictConfig)`` for tools that are not Hydra entry points themselves
    (apriel-submit, apriel-plan, the SLURM job's steps): same presets, overrides and checks."""
    cfg = compose_config(config_name, overrides, config_dir)
    return to_run_config(cfg), cfg
