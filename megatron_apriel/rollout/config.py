"""Settings of rollout generation: sampling (``SamplingConfig``), the actor (``actor.*``), the vLLM
fleet (``fleet.*``) and where the trainer's groups come from (``rollout.*``). A leaf: standard
library only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_apriel.choices import RolloutSource, check_choice, choices
from megatron_apriel.sampling.domain_sampler import SamplerConfig
from megatron_apriel.verifiers.config import VerifiersConfig


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings (the server detokenises to find them; token ids still hold every token)."""
    ignore_eos: bool = False
    seed: Optional[int] = None

    def to_vllm(self, n: int) -> dict:
        params = {"n": n, "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "logprobs": 0, "ignore_eos": self.ignore_eos, "stop_token_ids": list(self.stop_token_ids)}
        if self.stop:
            params["stop"] = list(self.stop)
        if self.seed is not None:
            params["seed"] = self.seed
        return params


@dataclass(kw_only=True)
class ActorConfig:
    data: list[str] = field(default_factory=list)
    """Problem files (jsonl or parquet, see tools/prepare_data.py); relative paths are taken from
    the working directory. Every domain of the sampler's mix needs problems in them."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    max_in_flight: int = 256
    """Groups being generated or verified at once (each asks the fleet for G sequences)."""
    max_queued_steps: int = 4
    """At most this many steps' worth of groups (groups_per_step each, filtered ones included) wait
    ahead of the trainer, whatever max_lag: the stream stops growing while the trainer is down."""
    verifier_workers: int = 4
    """Processes that run the verifiers (the code sandbox and math-verify's timers need processes)."""
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    """The verifiers' settings, as each verifier process builds them (sandbox limits, SandboxFusion, math timeouts)."""
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    """Stop strings for vLLM (the token ids of the stop string stay in the completion)."""
    max_prompt_tokens: int = 4096
    """Longer rendered prompts are skipped (and counted); trainer.seq_len must fit this plus the budget."""
    flush_interval_s: float = 1.0
    """Finished groups are written at least this often (and at once when the trainer waits)."""
    poll_s: float = 0.1
    """How often the trainer's progress is read while nothing finishes."""
    metrics_every_s: float = 10.0

    def __post_init__(self) -> None:
        if min(self.max_in_flight, self.max_queued_steps, self.verifier_workers, self.max_prompt_tokens) < 1:
            raise ValueError("actor.max_in_flight, max_queued_steps, verifier_workers and max_prompt_tokens "
                             "must be >= 1.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"actor.top_p={self.top_p} must be in (0, 1].")
        if min(self.flush_interval_s, self.poll_s, self.metrics_every_s) <= 0:
            raise ValueError("actor.flush_interval_s, poll_s and metrics_every_s must be > 0.")


@dataclass(frozen=True)
class ServerArgs:
    """``vllm serve`` flags, parsed in one place: what the launchers, the planner and ``apriel-serve``
    read from ``fleet.vllm_args`` (``--flag value`` and ``--flag=value`` alike)."""

    argv: tuple[str, ...] = ()

    def value(self, *flags: str) -> Optional[str]:
        """The value of the first of ``flags`` given (a flag's spellings, e.g. --tensor-parallel-size, -tp)."""
        for i, a in enumerate(self.argv):
            for flag in flags:
                if a == flag and i + 1 < len(self.argv):
                    return self.argv[i + 1]
                if a.startswith(flag + "="):
                    return a.split("=", 1)[1]
        return None

    def given(self, flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in self.argv)

    def with_default(self, flag: str, value: Optional[str] = None) -> ServerArgs:
        """These flags plus ``flag`` (with ``value``; a switch without) unless it is given already."""
        if self.given(flag):
            return self
        return ServerArgs(self.argv + ((flag,) if value is None else (flag, value)))

    @property
    def max_model_len(self) -> Optional[int]:
        v = self.value("--max-model-len")
        return None if v is None else int(v)

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.value("--tensor-parallel-size", "-tp") or 1)

    @property
    def gpu_memory_utilization(self) -> float:
        return float(self.value("--gpu-memory-utilization") or 0.9)  # vLLM's default

    @property
    def host(self) -> str:
        return self.value("--host") or "0.0.0.0"

    @property
    def port(self) -> int:
        return int(self.value("--port") or 8000)


@dataclass(kw_only=True)
class FleetConfig:
    """The vLLM servers that generate rollouts (``apriel-serve``, one per node or GPU group)."""

    servers: list[str] = field(default_factory=list)
    """Base URLs of servers that are already running. Empty: discover them in run_dir/fleet/
    (the launcher, or SLURM, starts them with ``--register-dir``)."""
    num_servers: int = 1
    """Servers the local launcher starts, and how many the trainer and the actor wait for."""
    host: str = "127.0.0.1"
    """Where the local launcher's servers listen."""
    port: int = 0
    """First port of the local servers (server i uses port + i); 0: free ports."""
    vllm_args: list[str] = field(default_factory=list)
    """Extra ``vllm serve`` flags, e.g. [--max-model-len, "20480", --tensor-parallel-size, "1"]
    (read through ``ServerArgs``)."""
    startup_timeout_s: float = 900.0
    """How long a server may take to answer /health (vLLM loads and compiles the model first)."""
    max_restarts: int = 3
    """Restarts of a crashed server by the local launcher before the run fails."""
    request_attempts: int = 8
    """Tries of one generation request (a failed server's requests go to another one)."""
    cooldown_s: float = 2.0
    """A server that failed gets no request for this long."""
    request_timeout_s: float = 3600.0
    stall_timeout_s: Optional[float] = 300.0
    """A server with requests in flight that produces no token for this long (its /metrics counter)
    is treated as failed and its requests go elsewhere; null: never (weight updates pause it briefly)."""

    def __post_init__(self) -> None:
        if self.num_servers < 1 and not self.servers:
            raise ValueError("fleet.num_servers must be >= 1 (or list running servers in fleet.servers).")
        if not 0 <= self.port < 65536:
            raise ValueError(f"fleet.port={self.port} is not a port; 0 picks free ones.")
        if min(self.startup_timeout_s, self.cooldown_s, self.request_timeout_s) <= 0 or self.request_attempts < 1:
            raise ValueError("fleet timeouts and cooldown_s must be > 0 and request_attempts >= 1.")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 0:
            raise ValueError(f"fleet.stall_timeout_s={self.stall_timeout_s} must be > 0 (or null: no watchdog).")
        if self.max_restarts < 0:
            raise ValueError("fleet.max_restarts must be >= 0.")

    @property
    def server_args(self) -> ServerArgs:
        return ServerArgs(tuple(self.vllm_args))


SOURCES = choices(RolloutSource)


@dataclass(kw_only=True)
class LocalRolloutConfig:
    """The self-sampling source (``rollout.source=local``): random prompts, a toy reward."""

    prompt_len: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError("rollout.local.prompt_len must be >= 1.")


@dataclass(kw_only=True)
class RolloutConfig:
    source: str = "fleet"
    """fleet: the actor's groups from vLLM, through the durable stream (the recipe); local: the
    trainer samples from its own model with a toy reward (fast unit tests, no vLLM); replay: train
    again on a recorded stream (``replay_from``), read-only, with no fleet (ablations, audits,
    the exact-resume tests)."""
    replay_from: Optional[str] = None
    """source=replay: the rollouts/ directory of an earlier run."""
    group_size: int = 8
    """G: completions per prompt (advantages compare a group's rollouts)."""
    groups_per_step: int = 128
    """Usable groups (prompts) per optimizer step: 128 x 8 = 1024 sequences in the recipe."""
    max_lag: Optional[int] = None
    """Largest policy lag (trainer step minus the oldest weight version of a group's tokens) a
    trained group may have; 0 is synchronous on-policy RL. Null: unbounded (the recipe)."""
    routing_replay: bool = False
    """Mixture-of-experts models: vLLM returns the experts it routed each token to, the actor keeps
    them in the rollout record and the trainer routes every token to those experts in its forward
    (rollout routing replay, arXiv 2510.11370), while the router's own scores still weight them and
    get gradients. Off: the trainer routes by itself (``train/routing_mismatch`` reports how often
    that differs from vLLM either way). The MoE presets turn it on; ignored for dense models."""
    local: LocalRolloutConfig = field(default_factory=LocalRolloutConfig)

    def __post_init__(self) -> None:
        check_choice("rollout.source", self.source, RolloutSource)
        if self.group_size < 2:
            raise ValueError("rollout.group_size must be >= 2 (advantages compare a group's rollouts).")
        if self.groups_per_step < 1:
            raise ValueError("rollout.groups_per_step must be >= 1.")
        if self.max_lag is not None and self.max_lag < 0:
            raise ValueError(f"rollout.max_lag={self.max_lag}: use 0 (synchronous), a positive bound or null.")
        if (self.source == "replay") != (self.replay_from is not None):
            raise ValueError("rollout.source=replay and rollout.replay_from=RUN_DIR/rollouts go together.")
