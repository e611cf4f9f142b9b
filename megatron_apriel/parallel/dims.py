"""Parallel sizes and their validation (pure: no torch.distributed)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_apriel.choices import CpCommType, check_choice, choices

CP_COMM_TYPES = choices(CpCommType)


def cp_alignment(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What every packed sequence's length must be a multiple of: 2 x cp chunks (each also split over
    tp with sequence parallelism) under context parallelism; 1 without it."""
    return 1 if cp == 1 else 2 * cp * (tp if sequence_parallel else 1)


@dataclass(kw_only=True)
class ParallelConfig:
    """How the trainer ranks are split. The data-parallel size is what is left of the world."""

    tp: int = 1
    """Tensor-parallel size (Megatron TP). Must divide the number of attention heads and KV groups."""
    pp: int = 1
    """Pipeline-parallel size. Must divide the number of layers."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): each expert lives on one of ``ep`` ranks,
    which are carved out of the tensor- and data-parallel ranks of a stage, as Megatron does (expert
    tensor parallelism is 1). Must divide the number of experts and tp * dp."""
    cp: int = 1
    """Context-parallel size (Megatron CP): each packed sequence is split into 2 x cp load-balanced
    chunks over cp ranks, which attend to each other's keys and values. Needs trainer.packing=true;
    the ranks of a CP group hold the same weights and the same samples."""
    cp_comm_type: str = "p2p"
    """How Transformer Engine's attention exchanges keys and values over the CP group on GPUs (Megatron's
    ``cp_comm_type``): p2p (a ring, overlapped with compute), all_gather, a2a or a2a+p2p. The CPU path
    all-reduces the whole row's keys and values instead (``model.attention``)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1). Saves activation memory on long rollouts."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl with CUDA, gloo without), nccl or gloo."""
    timeout_minutes: int = 30
    """Collective timeout for the trainer's process groups."""

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.ep, self.cp) < 1:
            raise ValueError(f"parallel.tp, parallel.pp, parallel.ep and parallel.cp must be >= 1, got tp={self.tp} "
                             f"pp={self.pp} ep={self.ep} cp={self.cp}.")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1; set it to false.")
        check_choice("parallel.cp_comm_type", self.cp_comm_type, CpCommType)
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"parallel.backend must be auto, nccl or gloo, got {self.backend!r}.")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved sizes for one world: world = tp * cp * pp * dp. Experts are split over ``ep`` ranks of
    the tp * cp * dp ranks of each stage; each expert is replicated on ``expert_dp`` of them."""

    tp: int
    pp: int
    dp: int
    ep: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Data-parallel replicas of each expert (Megatron's expert data-parallel size)."""
        return self.tp * self.cp * self.dp // self.ep

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        mp = cfg.tp * cfg.cp * cfg.pp
        if world_size % mp:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*cp*pp = {cfg.tp}*{cfg.cp}*{cfg.pp} = {mp}; "
                f"launch a multiple of {mp} trainer ranks or change parallel.tp / parallel.cp / parallel.pp."
            )
        dp = world_size // mp
        if (cfg.tp * cfg.cp * dp) % cfg.ep:
            raise ValueError(
                f"parallel.ep={cfg.ep} must divide tp*cp*dp = {cfg.tp}*{cfg.cp}*{dp} = {cfg.tp * cfg.cp * dp} (the "
                "ranks of a pipeline stage, which Megatron splits into expert-parallel groups); choose ep among its "
                "divisors, or launch more trainer ranks."
            )
        return cls(tp=cfg.tp, pp=cfg.pp, dp=dp, ep=cfg.ep, cp=cfg.cp)

    def check_model(self, *, num_layers: int, num_heads: int, num_kv_heads: int, num_experts: int = 0) -> None:
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
        if self.ep > 1 and not num_experts:
            raise ValueError(f"ep={self.ep} needs a mixture-of-experts model; this one is dense: set parallel.ep=1.")
        if num_experts and num_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide the number of experts ({num_experts}); choose ep among its "
                             "divisors.")
