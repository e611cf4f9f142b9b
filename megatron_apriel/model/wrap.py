"""Megatron DDP, the (distributed) optimizer and the LR schedule around one model stage."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from megatron_apriel.parallel.groups import ParallelContext


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (Apriel configs: 5e-7; GSPO script and PipelineRL default: 1e-6)."""
    min_lr: float = 0.0
    warmup_steps: int = 50
    """Linear warm-up from 0 to lr over this many optimizer steps."""
    decay_style: str = "cosine"
    """cosine, linear or constant after warm-up."""
    decay_steps: Optional[int] = None
    """Steps over which the LR decays to min_lr; null = the run's trainer.steps."""
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 0.1
    """Global gradient-norm clip (Apriel: 0.1; PipelineRL default 0.3)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron distributed optimizer)."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim needs 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}.")
        if self.decay_style not in ("cosine", "linear", "constant"):
            raise ValueError(f"optim.decay_style must be cosine, linear or constant, got {self.decay_style!r}.")
        if self.warmup_steps < 0 or self.clip_grad < 0:
            raise ValueError("optim.warmup_steps and optim.clip_grad must be >= 0.")


def wrap_model(model, ctx: ParallelContext, grad_reduce_in_fp32: bool = True):
    """Megatron DDP (contiguous grad buffers, reduce at the end of the step) around one stage."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=True,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model, pg_collection=ctx.pgs)
    model.config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=ctx.pgs)
    model.config.no_sync_func = ddp.no_sync
    return [ddp]


def build_optimizer(chunks, cfg: OptimConfig, ctx: ParallelContext, total_steps: int):
    """Adam(W) from Megatron (distributed over DP when configured) plus its LR/WD schedule."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dtype = chunks[0].module.config.params_dtype
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.distributed_optimizer,
    )
    # Our groups are already gloo on CPU; the extra gloo groups Megatron adds for NCCL runs are not needed.
    optimizer = get_megatron_optimizer(opt_config, chunks, use_gloo_process_groups=False, pg_collection=ctx.pgs)
    decay = cfg.decay_steps or total_steps
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=max(decay, cfg.warmup_steps + 1),
        lr_decay_style=cfg.decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=max(decay, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler
