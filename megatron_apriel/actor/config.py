"""Settings of the actor (``actor.*``): its problem files, domain sampler, verifiers, environments
and their limits, concurrency and flushing. A leaf: standard library only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_apriel.envs.config import EnvsConfig
from megatron_apriel.sampling.domain_sampler import SamplerConfig
from megatron_apriel.verifiers.config import VerifiersConfig


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
    """Processes that hold the episodes and run the verifiers and tools (``actor/episodes.py``: the
    code sandbox, math-verify's timers and the tool calls' forks need single-threaded processes);
    a group's episodes stay in one of them."""
    environments: dict[str, str] = field(default_factory=dict)
    """The environment of each domain's problems, by name (``envs/registry.py``), e.g.
    ``{math: arithmetic}``; a domain left out is single-turn: the environment of its verifier (named
    after the domain). A problem whose ``metadata["environment"]`` is set runs that one whatever
    its domain says (BFCL multi-turn rows carry ``bfcl_multi_turn``)."""
    envs: EnvsConfig = field(default_factory=EnvsConfig)
    """The environments' settings (``envs/config.py``): one tool call's time and memory limits
    (``envs.calls.timeout_s``, ``memory_mb``), BFCL multi-turn's and the calculator's step limits."""
    max_turns: int = 16
    """Model turns in one trajectory; one that would need more (the environment answers its
    ``max_turns``-th turn) is stopped there, recorded truncated and scored as it is."""
    max_trajectory_tokens: Optional[int] = None
    """Completion tokens of one trajectory, the model's and the environment's together (each turn
    asks for at most what is left); an environment turn that would leave no room for a model token
    stops the trajectory, truncated. None: ``rewards.max_len`` (one turn's budget: a single-turn
    rollout is as before). ``trainer.seq_len`` must hold ``max_prompt_tokens`` plus this."""
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
        if self.max_turns < 1:
            raise ValueError(f"actor.max_turns={self.max_turns}: a trajectory has at least one model turn; "
                             "set it >= 1.")
        if self.max_trajectory_tokens is not None and self.max_trajectory_tokens < 1:
            raise ValueError(f"actor.max_trajectory_tokens={self.max_trajectory_tokens} must be >= 1, or null "
                             "(rewards.max_len).")
        for domain, env in self.environments.items():
            if not isinstance(env, str) or not env:
                raise ValueError(f"actor.environments.{domain}={env!r}: give an environment's name (envs/registry.py), "
                                 "e.g. actor.environments={math: arithmetic}.")

    def environment(self, domain: str, metadata: Optional[dict] = None) -> str:
        """The environment that runs a problem of ``domain`` (with its ``metadata``): the problem's
        own, else the domain's in ``environments``, else the domain's single-turn verifier."""
        named = (metadata or {}).get("environment")
        return named or self.environments.get(domain, domain)
