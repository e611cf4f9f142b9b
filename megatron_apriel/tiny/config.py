"""Settings of the tiny CPU base (``tiny_base.*``). A leaf: standard library only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TinyBaseConfig:
    """Build the tiny run's base model into ``run_dir/base`` on first use (``model.hf_path`` then
    points there). Off by default; the ``tiny_cpu`` preset turns it on."""

    enabled: bool = False
    max_operand: int = 4
    """Problems are a + b for 0 <= a, b <= max_operand (25 problems)."""
    sft_steps: int = 60
    """Supervised steps of the warm start: the format is learnt, about half of the sums are right
    when sampled at temperature 1 (measured on this seed), so RL has room to raise the reward."""
    sft_lr: float = 3e-3
    sft_batch: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_operand < 1 or self.sft_steps < 0 or self.sft_batch < 1 or self.sft_lr <= 0:
            raise ValueError("tiny_base.max_operand and sft_batch must be >= 1, sft_steps >= 0, sft_lr > 0.")
