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
    num_experts: int = 0
    """0: the base is a tiny Llama; else a tiny Qwen3-MoE with this many experts (top-2) per layer."""
    max_positions: int = 512
    """The model's context (``max_position_embeddings``): BFCL multi-turn prompts take ~8k of its
    tokens (``smoke_multiturn``)."""

    def __post_init__(self) -> None:
        if self.num_experts == 1 or self.num_experts < 0:
            raise ValueError("tiny_base.num_experts must be 0 (a dense base) or >= 2 (top-2 routing).")
        if self.max_positions < 64:
            raise ValueError(f"tiny_base.max_positions={self.max_positions} must be >= 64.")
        if self.max_operand < 1 or self.sft_steps < 0 or self.sft_batch < 1 or self.sft_lr <= 0:
            raise ValueError("tiny_base.max_operand and sft_batch must be >= 1, sft_steps >= 0, sft_lr > 0.")
