"""Reward shaping and group statistics (RECIPE.md sections 2.2, 2.3 and 4).

Pure functions over one *group*: the G rollouts of one prompt (G = 8 in the recipe). Inputs are
plain sequences of length G; lengths are in output tokens; rewards are unitless floats. The actor
calls `shape_group_rewards` once the whole group has finished, then `group_advantages`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

ADVANTAGE_MODES = ("loo", "group_norm")


@dataclass(kw_only=True)
class RewardConfig:
    """Reward shaping, advantages and group filters of the recipe."""

    max_len: int = 16000
    """L: the training output budget in tokens; a rollout that reaches it is truncated."""

    buffer: int = 4096
    """B: the penalty zone is (L - B, L]; 0 turns the length penalty off. Assumed (RECIPE 9.2)."""

    dap_enabled: bool = True
    """Difficulty-aware penalty: scale the length penalty by the group's solve rate."""

    gamma: float = 1.0
    """DAP exponent: a correct rollout's penalty is scaled by s**gamma (s = group solve rate)."""

    failure_scale: float = 1.0
    """DAP lambda_f: the scale of the length penalty on incorrect rollouts."""

    advantage_mode: str = "loo"
    """'loo': r_i - mean_{j != i} r_j (no std division, the recipe); 'group_norm': (r - mean)/(std + eps)."""

    advantage_eps: float = 1e-4
    """eps added to the std in 'group_norm' mode."""

    filter_zero_advantage_groups: bool = True
    """Dynamic sampling: drop groups whose advantages are all within `zero_advantage_tol` of 0."""

    zero_advantage_tol: float = 1e-6
    """|A| at or below this counts as zero for the filter."""


    def __post_init__(self) -> None:
        if self.max_len <= 0:
            raise ValueError(f"max_len={self.max_len}: must be > 0 (16000 in the recipe).")
        if not 0 <= self.buffer <= self.max_len:
            raise ValueError(f"buffer={self.buffer}: need 0 <= buffer <= max_len={self.max_len}.")
        if self.gamma < 0 or self.failure_scale < 0:
            raise ValueError(f"gamma={self.gamma}, failure_scale={self.failure_scale}: both must be >= 0.")
        if self.advantage_mode not in ("loo", "group_norm"):
            raise ValueError(f"advantage_mode={self.advantage_mode!r}: use 'loo' or 'group_norm'.")
        if self.advantage_eps <= 0 or self.zero_advantage_tol < 0:
            raise ValueError("advantage_eps must be > 0 and zero_advantage_tol >= 0.")


def length_penalty(length: int, max_len: int, buffer: int) -> float:
    """Linear overlong penalty P(l) in [-1, 0].

    P(l) = ((L - B) - l) / B for L - B < l <= L, else 0; so P(L) = -1. `length` is the number of
    output tokens; `buffer` = 0 disables the penalty.
    """
    if not 0 <= buffer <= max_len:
        raise ValueError(f"buffer={buffer}: need 0 <= buffer <= max_len={max_len}.")
    if buffer == 0 or not max_len - buffer < length <= max_len:
        return 0.0
    return ((max_len - buffer) - length) / buffer


def task_reward(score: float, truncated: bool) -> float:
    """R: the verifier's score for a finished completion, 0 for one cut at the budget (the Apriel
    configs' ``success_and_format`` table: only a finished answer earns reward)."""
    return 0.0 if truncated else float(score)


def group_solve_rate(correct: Sequence[bool]) -> float:
    """s = (#correct) / G for one group."""
    if len(correct) == 0:
        raise ValueError("empty group: a group needs at least one rollout.")
    return sum(bool(c) for c in correct) / len(correct)


def difficulty_aware_rewards(rewards: Sequence[float], lengths: Sequence[int], correct: Sequence[bool],
                             truncated: Sequence[bool], max_len: int, buffer: int, gamma: float = 1.0,
                             failure_scale: float = 1.0) -> list[float]:
    """DAP for one group: returns r_i = R_i + lambda_i * P(l_i), a list of G floats.

    `rewards` are the task rewards R_i *without* any length penalty. With s = group_solve_rate:
    lambda_i = s**gamma if correct_i else failure_scale, except the hard-cap guard: lambda_i = 1
    when the rollout was cut at the budget (truncated_i and l_i >= L). Easy groups (s = 1) get the
    full penalty; in a group with 1/8 solved, the correct rollouts get 1/8 of it.
    """
    _check_same_length(rewards=rewards, lengths=lengths, correct=correct, truncated=truncated)
    s = group_solve_rate(correct)
    shaped = []
    for r, length, c, t in zip(rewards, lengths, correct, truncated):
        if t and length >= max_len:
            scale = 1.0
        elif c:
            scale = s ** gamma
        else:
            scale = failure_scale
        shaped.append(float(r) + scale * length_penalty(length, max_len, buffer))
    return shaped


def shape_group_rewards(config: RewardConfig, rewards: Sequence[float], lengths: Sequence[int],
                        correct: Sequence[bool], truncated: Sequence[bool]) -> list[float]:
    """R + P(l) with DAP when `config.dap_enabled`, else the plain penalty (lambda = 1)."""
    if config.dap_enabled:
        return difficulty_aware_rewards(rewards, lengths, correct, truncated, config.max_len,
                                        config.buffer, config.gamma, config.failure_scale)
    _check_same_length(rewards=rewards, lengths=lengths)
    return [float(r) + length_penalty(length, config.max_len, config.buffer)
            for r, length in zip(rewards, lengths)]


def group_advantages(rewards: Sequence[float], mode: str = "loo", eps: float = 1e-4) -> list[float]:
    """Advantages of one group of G >= 2 rewards.

    'loo' (leave-one-out, the recipe): A_i = r_i - mean_{j != i} r_j, no std division.
    'group_norm' (GSPO paper): A_i = (r_i - mean_j r_j) / (std_j r_j + eps), population std.
    """
    r = [float(x) for x in rewards]
    g = len(r)
    if g < 2:
        raise ValueError(f"need a group of at least 2 rewards, got {g}.")
    total = math.fsum(r)
    if mode == "loo":
        return [x - (total - x) / (g - 1) for x in r]
    if mode == "group_norm":
        mean = total / g
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in r) / g)
        return [(x - mean) / (std + eps) for x in r]
    raise ValueError(f"mode={mode!r}: use 'loo' or 'group_norm'.")


def is_zero_advantage_group(advantages: Sequence[float], tol: float = 1e-6) -> bool:
    """True when every |A_i| <= tol: the group carries no signal and dynamic sampling drops it."""
    return all(abs(a) <= tol for a in advantages)


def _check_same_length(**seqs: Sequence) -> None:
    sizes = {name: len(s) for name, s in seqs.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"group inputs differ in length: {sizes}; pass one entry per rollout.")
