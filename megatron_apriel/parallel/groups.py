"""Initialise torch.distributed and Megatron's groups once; hand out one ``ParallelContext``.

Our code never reads ``megatron.core.parallel_state``: it takes the context (and its
``ProcessGroupCollection``) as an argument. Megatron itself still keeps its module globals; they
are set here and torn down by ``destroy_parallel``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_apriel._patches import apply_cpu_patches
from megatron_apriel.parallel.dims import ParallelConfig, ParallelDims


@dataclass(frozen=True)
class ParallelContext:
    """Everything a trainer component needs to know about where it runs."""

    dims: ParallelDims
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    pgs: object  # megatron.core.process_groups_config.ProcessGroupCollection
    sequence_parallel: bool = False
    ep_rank: int = 0
    """Which slice of every MoE layer's experts this rank holds (0 when ep = 1)."""
    expert_dp_rank: int = 0
    """This rank's index among the replicas of its experts (Megatron's expert data-parallel rank)."""
    cp_rank: int = 0
    """This rank's index in its context-parallel group (which chunks of each sequence it holds)."""
    cp_comm_type: str = "p2p"
    """``parallel.cp_comm_type``: how TE's attention exchanges keys and values over the CP group (GPU)."""

    def local_experts(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds."""
        per_rank = num_experts // self.dims.ep
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The rank that writes metrics: last pipeline stage, first TP, CP and DP rank."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0


def _backend(cfg: ParallelConfig) -> str:
    if cfg.backend != "auto":
        if cfg.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("parallel.backend=nccl needs CUDA; use gloo (or auto) on a CPU machine.")
        return cfg.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(cfg: ParallelConfig, seed: int = 1234) -> ParallelContext:
    """Join the process group launched by torchrun/srun and build Megatron's groups.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (and LOCAL_RANK on GPU) from the
    environment, as torchrun and our SLURM scripts set them.
    """
    apply_cpu_patches()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    backend = _backend(cfg)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=cfg.timeout_minutes))
    dims = ParallelDims.resolve(cfg, dist.get_world_size())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=cfg.timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    return ParallelContext(
        dims=dims,
        rank=dist.get_rank(),
        tp_rank=dist.get_rank(pgs.tp),
        pp_rank=dist.get_rank(pgs.pp),
        dp_rank=dist.get_rank(pgs.dp),
        device=device,
        pgs=pgs,
        sequence_parallel=cfg.sequence_parallel,
        ep_rank=dist.get_rank(pgs.ep),
        expert_dp_rank=dist.get_rank(pgs.expt_dp),
        cp_rank=dist.get_rank(pgs.cp),
        cp_comm_type=cfg.cp_comm_type,
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
