"""Settings of the actor (``actor.*``): its problem files, domain sampler, verifiers, concurrency
and flushing. A leaf: standard library only."""

from __future__ import annotations

from dataclasses import dataclass, field

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
