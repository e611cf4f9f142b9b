"""The run's typed configuration, composed from each component's own config dataclass.

The dataclasses are registered in Hydra's ConfigStore as the schema ``run_schema``; the YAML
presets in ``conf/`` hold overrides only. Hydra rejects unknown keys and ill-typed values (naming
the key); ``to_run_config`` then builds the dataclasses, whose ``__post_init__`` checks ranges and
says how to fix a bad value. ``RunConfig`` checks what spans components: one output budget
(``rewards.max_len`` is vLLM's ``max_tokens``; ``trainer.seq_len`` must hold the longest prompt
plus it) and one temperature (``loss.temperature`` is also the sampling temperature).

The domain mix (``actor.sampler.weights``) is written out in every config composed here: the
preset's, or the paper's (``DOMAIN_MIX_PAPER``) where the preset gives none. Its overrides are
applied by `complete_mix`, not by Hydra, which merges a dict into a dict and cannot fill a null:

    actor.sampler.weights={math:0.6,code:0.4}     the whole mix (domains left out are not sampled)
    actor.sampler.weights.code=0.3                change one domain of the mix
    +actor.sampler.weights.DOMAIN=W               add one (++: add or change)
    ~actor.sampler.weights.DOMAIN                 drop one

The schema's default stays null (the paper's mix) so that a preset's mix replaces it instead of
being merged into it. Every composition goes through `compose_config`, which does this.

One resolved config per run. A launcher (``apriel-train``; ``job_step prepare`` on SLURM) composes
once (`launch_config`) and writes the typed, resolved config to ``run_dir/config.yaml``
(`save_run_config`); every other process of the run reads it back (`load_run_config`): trainer
ranks, the actor, the SLURM job's serve and export steps, apriel-eval's base-model lookup. A
relaunch or a requeue of the same run directory reads the saved config again, not the preset
files: the command's overrides (``key=value``) are applied on top of it, and they are the way to
change a setting of a run that exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from megatron_apriel.actor.config import ActorConfig
from megatron_apriel.files import atomic_write
from megatron_apriel.fleet.config import FleetConfig, SamplingConfig
from megatron_apriel.model.config import ModelConfig, OptimConfig
from megatron_apriel.parallel.dims import ParallelConfig, cp_alignment
from megatron_apriel.records.config import RolloutConfig
from megatron_apriel.rewards import RewardConfig
from megatron_apriel.run_dir import RunDir
from megatron_apriel.sampling.domain_sampler import DOMAIN_MIX_PAPER
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
    gpus_per_node: int = 0
    """GPUs of this machine that the run shares between the vLLM servers (first, each taking its
    --tensor-parallel-size x --pipeline-parallel-size) and the trainer's ranks (the next
    ``nproc_per_node``); each process gets its own CUDA_VISIBLE_DEVICES (``parallel/devices.py``).
    0: assign none (a CPU machine, or devices handed out by hand)."""
    dry_run: bool = False
    """Print the processes, ranks and resources the run would start, then exit."""
    export_hf: bool = True
    """Convert the final checkpoint into run_dir/hf/ (loadable by transformers, servable by apriel-serve)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError("launch.nnodes and launch.nproc_per_node must be >= 1.")
        if self.gpus_per_node < 0:
            raise ValueError(f"launch.gpus_per_node must be >= 0 (0: a CPU machine), got {self.gpus_per_node}.")
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

    @property
    def paths(self) -> RunDir:
        """Where this run's files are (``run_dir``'s layout)."""
        return RunDir(self.run_dir)

    def __post_init__(self) -> None:
        if self.tiny_base.enabled and self.model.hf_path is not None:
            base = RunDir(Path(self.run_dir).resolve()).base
            if Path(self.model.hf_path).resolve() != base:
                raise ValueError(f"tiny_base.enabled builds the model into {base}, but model.hf_path="
                                 f"{self.model.hf_path}: leave model.hf_path unset or turn tiny_base off.")
        budget = self.rewards.max_len
        if self.rollout.source == "local":
            need = self.rollout.local.prompt_len + budget
            what = f"rollout.local.prompt_len={self.rollout.local.prompt_len}"
        else:
            need = self.actor.max_prompt_tokens + (self.actor.max_trajectory_tokens or budget)
            what = f"actor.max_prompt_tokens={self.actor.max_prompt_tokens}"
        budget_key = (f"actor.max_trajectory_tokens={self.actor.max_trajectory_tokens}"
                      if self.rollout.source != "local" and self.actor.max_trajectory_tokens
                      else f"rewards.max_len={budget}")
        if self.trainer.seq_len < need:
            raise ValueError(f"trainer.seq_len={self.trainer.seq_len} cannot hold a prompt of {what} plus the output "
                             f"budget {budget_key}: set trainer.seq_len>={need} or lower one of them.")
        if self.parallel.sequence_parallel and self.trainer.seq_len % self.parallel.tp:
            raise ValueError(f"parallel.sequence_parallel=true splits every row's {self.trainer.seq_len} positions "
                             f"over parallel.tp={self.parallel.tp} ranks: set trainer.seq_len to a multiple of "
                             f"{self.parallel.tp}.")
        self._check_context_parallel()
        self._check_correction_anchor()
        if self.rollout.source == "fleet" and not (self.model.hf_path or self.tiny_base.enabled):
            raise ValueError("rollout.source=fleet serves model.hf_path with vLLM: set model.hf_path to a Hugging "
                             "Face model directory.")

    def _check_correction_anchor(self) -> None:
        """The unclipped correction needs a bound on staleness: only C would bound a stale token."""
        loss, rollout = self.loss, self.rollout
        if loss.correction == "none" or loss.correction_anchor != "current":
            return
        if rollout.max_lag is None and rollout.source != "local":  # the local source samples from the trained weights
            raise ValueError(f"loss.correction={loss.correction} with loss.correction_anchor=current takes the ratio "
                             "against the step's own weights, so the clip never binds, and rollout.max_lag=null lets "
                             "a token be any number of versions stale: nothing but C would bound its step. Set "
                             "rollout.max_lag (e.g. 1), or loss.correction_anchor=behaviour (the recipe's clip on "
                             "pi/mu, the correction on top).")

    def _check_context_parallel(self) -> None:
        cp = self.parallel.cp
        if cp == 1:
            return
        if not self.trainer.packing:
            raise ValueError(f"parallel.cp={cp} splits packed rows (THD): set trainer.packing=true.")
        if self.rollout.source == "local":
            raise ValueError(f"parallel.cp={cp}: rollout.source=local generates with the trainer's own model, which "
                             "CP splits; use rollout.source=fleet (or replay).")
        align = cp_alignment(cp, self.parallel.tp, self.parallel.sequence_parallel)
        if self.trainer.seq_len % align:
            sp = " x parallel.tp (sequence parallelism)" if self.parallel.sequence_parallel else ""
            raise ValueError(f"parallel.cp={cp} cuts every sequence into 2 x cp chunks{sp}: set trainer.seq_len to "
                             f"a multiple of {align}, e.g. {-(-self.trainer.seq_len // align) * align}.")

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
        model = replace(self.model, hf_path=str(RunDir(run_dir).base)) if self.tiny_base.enabled else self.model
        return replace(self, run_dir=str(run_dir), model=model)


def register_configs() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Validated, resolved dataclasses from a composed config (runs every ``__post_init__`` check)."""
    run = OmegaConf.to_object(cfg)
    if not isinstance(run, RunConfig):
        raise TypeError("the config was not composed on run_schema; start the YAML with "
                        "`defaults: [run_schema, _self_]`.")
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


MIX_KEY = "actor.sampler.weights"
MIX_FORMS = (f"{MIX_KEY}={{math:0.6,code:0.4}} (the whole mix), {MIX_KEY}.code=0.3 (change one), "
             f"+{MIX_KEY}.DOMAIN=W (add one), ~{MIX_KEY}.DOMAIN (drop one)")


def split_mix_overrides(args: list[str]) -> tuple[list[str], list[Any]]:
    """``(the other arguments, the mix's overrides parsed)``: those of ``args`` whose key is
    ``actor.sampler.weights`` or under it, for `complete_mix`; the rest go to Hydra unchanged."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    rest, mix = [], []
    for arg in args:
        key = arg.lstrip("+~").partition("=")[0]
        if key != MIX_KEY and not key.startswith((MIX_KEY + ".", MIX_KEY + "@")):
            rest.append(arg)
            continue
        try:
            mix += OverridesParser.create().parse_overrides([arg])
        except HydraException as err:
            raise ValueError(hydra_error(err)) from err
    return rest, mix


def complete_mix(cfg: DictConfig, overrides: list[Any]) -> DictConfig:
    """Write the domain mix out in ``cfg`` (the preset's; DOMAIN_MIX_PAPER where it is null), then
    apply the mix's overrides in order (forms: the module docstring). Returns ``cfg``; an override
    that does not fit the mix raises ``ValueError`` naming it and the form that would work."""
    from omegaconf.errors import OmegaConfBaseException

    node = OmegaConf.select(cfg, MIX_KEY)
    mix = dict(DOMAIN_MIX_PAPER) if node is None else OmegaConf.to_container(node)
    for override in overrides:
        mix = _apply_mix_override(mix, override)
    try:
        OmegaConf.update(cfg, MIX_KEY, mix, merge=False)  # the mix as a whole, not merged into the preset's
    except OmegaConfBaseException as err:
        raise ValueError(f"{MIX_KEY}={mix}: {hydra_error(err)}") from err
    return cfg


def _apply_mix_override(mix: dict, override) -> dict:
    text = override.input_line
    domain = override.key_or_group[len(MIX_KEY) + 1:]
    if override.package is not None or override.is_sweep_override() or "." in domain:
        raise ValueError(f"override {text!r}: the domain mix takes {MIX_FORMS}.")
    if not domain:
        if override.is_delete() or not isinstance(override.value(), dict):
            raise ValueError(f"override {text!r}: give the whole mix as a dict, e.g. {MIX_KEY}={{math:0.6,code:0.4}}.")
        return dict(override.value())
    if override.is_delete():
        if domain not in mix:
            raise ValueError(f"override {text!r}: {domain!r} is not in the mix {sorted(mix)}.")
        return {d: w for d, w in mix.items() if d != domain}
    if override.is_add() and domain in mix:
        raise ValueError(f"override {text!r}: {domain!r} is in the mix already; change it with "
                         f"{MIX_KEY}.{domain}={override.value()}.")
    if not (override.is_add() or override.is_force_add()) and domain not in mix:
        raise ValueError(f"override {text!r}: {domain!r} is not in the mix {sorted(mix)}; add it with "
                         f"+{MIX_KEY}.{domain}={override.value()}.")
    return {**mix, domain: override.value()}


def compose_config(config_name: str, overrides: list[str], config_dir: Optional[str] = None) -> DictConfig:
    """The config of ``--config-name config_name overrides...`` as ``apriel-train`` composes it,
    the domain mix written out (`complete_mix`); ``config_dir`` adds a directory of the user's own
    presets (Hydra's ``--config-dir``). A preset that does not exist, an unknown key, an ill-typed
    value or a mix override that does not fit raises ``ValueError`` (one line).

    Hydra finds the primary config in its primary directory only (``hydra.searchpath`` serves the
    defaults lists): a preset of ``config_dir`` makes that directory primary, with the shipped
    presets on the search path; otherwise the shipped presets are primary."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    rest, mix = split_mix_overrides(overrides)
    own = Path(config_dir).resolve() if config_dir else None
    if own is not None and (own / f"{config_name}.yaml").is_file():
        context = initialize_config_dir(config_dir=str(own), version_base=None)
        extra = ["hydra.searchpath=[pkg://megatron_apriel.conf]"]
    else:
        context = initialize_config_module(config_module="megatron_apriel.conf", version_base=None)
        extra = [f"hydra.searchpath=[file://{own}]"] if own else []
    try:
        with context:
            cfg = compose(config_name=config_name, overrides=[*rest, *extra])
    except (HydraException, OmegaConfBaseException) as err:
        raise ValueError(hydra_error(err)) from err
    return complete_mix(cfg, mix)


def compose_run(config_name: str, overrides: list[str],
                config_dir: Optional[str] = None) -> tuple[RunConfig, DictConfig]:
    """``(RunConfig, DictConfig)`` for tools that are not Hydra entry points themselves
    (apriel-submit, apriel-plan, the SLURM job's steps): same presets, overrides and checks."""
    cfg = compose_config(config_name, overrides, config_dir)
    return to_run_config(cfg), cfg


SAVED_PREAMBLE = """\
# The resolved config of this run, written by its launcher (apriel-train, or the SLURM job's
# prepare step). Every process of the run reads it; a relaunch of this run directory reads it
# again (not the preset), with the relaunch's own overrides applied on top.
defaults: [run_schema, _self_]
"""
SAVED_NAME = "config"
"""``run_dir/config.yaml`` as a Hydra config name (the run directory is put on the search path)."""


def save_run_config(run: RunConfig) -> Path:
    """Write ``run`` to ``run_dir/config.yaml`` (atomically). With ``tiny_base.enabled`` the model
    path is left to be derived from the run directory again (``run_dir/base``), so that a copy of
    the run directory reads as itself."""
    node = OmegaConf.structured(run)
    if run.tiny_base.enabled:
        node.model.hf_path = None
    path = run.paths.config
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, SAVED_PREAMBLE + OmegaConf.to_yaml(node))
    return path


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The run of ``run_dir`` as its launcher saved it, checked as on launch; ``run_dir`` is where
    it was found (a copied run directory is itself)."""
    from omegaconf.errors import OmegaConfBaseException

    root = Path(run_dir).resolve()
    path = RunDir(root).config
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: a run's processes read the config its launcher wrote; "
                                "start the run with apriel-train (or apriel-submit on SLURM).")
    try:
        data = OmegaConf.load(path)
        data.pop("defaults", None)
        data.run_dir = str(root)  # saved with model.hf_path null where tiny_base derives it from run_dir
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), data)
    except OmegaConfBaseException as err:
        raise ValueError(f"{path}: {hydra_error(err)}") from err
    return to_run_config(cfg)


def launch_config(config_name: str, overrides: list[str], config_dir: Optional[str] = None) -> tuple[RunConfig, bool]:
    """``(the run a launcher starts, whether it is a relaunch)``. The preset and overrides give the
    run directory; when it holds a saved config (a relaunch, a requeue), that config is the base
    and only the overrides are applied to it: preset files are not read again. The same command
    run again gives the same run: an addition (``+key=value``) applies as add-or-change."""
    run = to_run_config(compose_config(config_name, overrides, config_dir))
    saved = run.paths.config
    if not saved.is_file() or "defaults" not in OmegaConf.load(saved):  # a new run, or one saved before this form
        return run, False
    again = [f"+{a}" if a.startswith("+") and not a.startswith("++") else a for a in overrides]  # add or change
    cfg = compose_config(SAVED_NAME, [*again, f"run_dir={run.run_dir}"], str(run.paths.root))
    return to_run_config(cfg), True
