"""Megatron DDP, the (distributed) optimizer and the LR schedule around one model stage."""

from __future__ import annotations

from functools import partial

import torch

from megatron_apriel.model.config import OptimConfig
from megatron_apriel.parallel.groups import ParallelContext


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
