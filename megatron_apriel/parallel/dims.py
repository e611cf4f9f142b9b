"""Parallel sizes and their validation (pure: no torch.distributed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ParallelConfig:
    """How the trainer ranks are split. The data-parallel size is what is left of the world."""

    tp: int = 1
    """Tensor-parallel size (Megatron TP). Must divide the number of attention heads and KV groups."""
    pp: int = 1
    """Pipeline-parallel size. Must divide the number of layers."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1). Saves activation memory on long rollouts."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl with CUDA, gloo without), nccl or gloo."""
    timeout_minutes: int = 30
    """Collective timeout for the trainer's process groups."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"parallel.tp and parallel.pp must be >= 1, got tp={self.tp} pp={self.pp}.")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1; set it to false.")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"parallel.backend must be auto, nccl or gloo, got {self.backend!r}.")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved sizes for one world: world = tp * pp * dp."""

    tp: int
    pp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        mp = cfg.tp * cfg.pp
        if world_size % mp:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*pp = {cfg.tp}*{cfg.pp} = {mp}; "
                f"launch a multiple of {mp} trainer ranks or change parallel.tp / parallel.pp."
            )
        return cls(tp=cfg.tp, pp=cfg.pp, dp=world_size // mp)

    def check_model(self, *, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        """Fail early, with the fix, when the model cannot be split this way."""
        if num_heads % self.tp or num_kv_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} must divide both the attention heads ({num_heads}) and the KV heads "
                f"({num_kv_heads}); choose tp among the common divisors."
            )
        if num_layers % self.pp:
            raise ValueError(
                f"pp={self.pp} must divide the number of layers ({num_layers}); choose another pp."
            )
