"""Settings of the rollout stream that both sides share (``rollout.*``): where the trainer's groups
come from, their size, how many per step and how stale they may be. A leaf: standard library only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_apriel.choices import RolloutSource, check_choice, choices

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
