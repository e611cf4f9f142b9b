"""Settings of the environments (``envs/``): the limits of one tool call and BFCL multi-turn's
step limit. A leaf: standard library only."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class ToolCallConfig:
    """How one tool call runs (``envs/tools.py``)."""

    timeout_s: float = 10.0
    """Wall-clock limit of one call; a call past it is answered with an error and changes nothing."""

    memory_mb: int = 1024
    """How much the call's forked process may grow its address space (RLIMIT_AS above its start)."""

    isolate: bool = True
    """Run each call in a forked child with the limits above (``envs/isolation.py``). False runs
    it in this process without any limit: only for trusted call sequences (tests, replays)."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb < 16:
            raise ValueError(f"need timeout_s > 0 and memory_mb >= 16, got {self.timeout_s} and {self.memory_mb}.")


@dataclass(kw_only=True)
class BfclMultiTurnConfig:
    max_steps_per_turn: int = 20
    """Model turns with calls allowed within one user turn; one more ends the episode, which BFCL
    then fails unless it was the last turn (BFCL's ``MAXIMUM_STEP_LIMIT``, 20)."""

    def __post_init__(self) -> None:
        if self.max_steps_per_turn < 1:
            raise ValueError(f"max_steps_per_turn must be >= 1, got {self.max_steps_per_turn}.")


@dataclass(kw_only=True)
class ArithmeticConfig:
    max_steps: int = 8
    """Model turns with calls allowed before the episode ends (and fails)."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}.")


@dataclass(kw_only=True)
class SelfCheckConfig:
    follow_ups: int = 1
    """How many times the user asks for a check after the first answer (model turns: one more)."""

    message: str = "Check your answer and give your final answer again."
    """The user's follow-up message."""

    def __post_init__(self) -> None:
        if self.follow_ups < 1 or not self.message.strip():
            raise ValueError(f"self_check needs follow_ups >= 1 and a message, got {self.follow_ups} and "
                             f"{self.message!r}.")


@dataclass(kw_only=True)
class EnvsConfig:
    calls: ToolCallConfig = field(default_factory=ToolCallConfig)
    bfcl_multi_turn: BfclMultiTurnConfig = field(default_factory=BfclMultiTurnConfig)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    self_check: SelfCheckConfig = field(default_factory=SelfCheckConfig)
