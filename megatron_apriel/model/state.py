"""Canonical (TP=1, PP=1, EP=1, unpadded-vocab) Megatron state dicts <-> this rank's shards.

The canonical form names every decoder layer by its global index, every expert by its global
index (``mlp.experts.local_experts.{e}``, as SequentialMLP names them at EP=1; TEGroupedMLP's
``mlp.experts.linear_fc1.weight{i}`` maps to the same name) and keeps only the true vocabulary
rows, so it is the same whatever the layout (TP, PP, EP, vocab padding). It is what the
layout-invariance tests compare and what conversion maps to Hugging Face names. Shards are cut
along the ``partition_dim`` Megatron records on each tensor-parallel parameter; the SwiGLU fc1
weight holds [gate; up] per rank, so it is cut per half. Expert parameters are not cut (expert
tensor parallelism is 1): a rank holds its experts whole.

Gathering materialises the whole model on every rank: meant for small models and tests. Large
checkpoints go through the streaming converter instead.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from megatron_apriel.parallel.groups import ParallelContext

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_SEQUENTIAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def layer_offset(model) -> int:
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def global_name(local: str, offset: int, expert_offset: int = 0) -> str:
    """The canonical name of a local parameter: global layer and expert indices."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local)
    name = _SEQUENTIAL_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + expert_offset}."
                                            f"{m.group(2)}.weight", name)
    return _GROUPED_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{int(m.group(2)) + expert_offset}."
                                         f"{m.group(1)}.weight", name)


def expert_offset(model, ctx: ParallelContext) -> int:
    """Global index of this rank's first expert (0 for a dense model)."""
    experts = model.config.num_moe_experts or 0
    return ctx.local_experts(experts).start if experts else 0


def is_expert_param(param) -> bool:
    """An expert's weight: Megatron marks them ``allreduce=False`` (reduced over expert-DP only)."""
    return not getattr(param, "allreduce", True)


def is_glu_fc1(name: str, model) -> bool:
    return name.endswith("mlp.linear_fc1.weight") and model.config.gated_linear_unit


def is_tp_sharded(param) -> bool:
    """Cut over the tensor-parallel ranks (expert weights are whole: expert TP = 1)."""
    return getattr(param, "tensor_model_parallel", False) and not is_expert_param(param)


def _shard(full: torch.Tensor, dim: int, tp: int, rank: int, glu: bool) -> torch.Tensor:
    if glu:
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[rank], up.chunk(tp, dim=dim)[rank]], dim=dim)
    return full.chunk(tp, dim=dim)[rank]


def unshard(parts: list[torch.Tensor], dim: int, glu: bool) -> torch.Tensor:
    if glu:
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def local_params(model, tied: bool):
    for name, param in model.named_parameters():
        if tied and name == "output_layer.weight":
            continue  # the tied copy of the embedding on the last stage
        yield name, param


@torch.no_grad()
def load_full_state_dict(model, full: dict[str, torch.Tensor], ctx: ParallelContext) -> None:
    """Copy a canonical state dict into this rank's stage/shard of ``model``."""
    tied = model.share_embeddings_and_output_weights
    offset, experts = layer_offset(model), expert_offset(model, ctx)
    for name, param in model.named_parameters():
        key = ("embedding.word_embeddings.weight" if tied and name == "output_layer.weight"
               else global_name(name, offset, experts))
        if key not in full:
            raise KeyError(f"canonical state dict has no {key!r} (needed by this rank's {name!r}).")
        src = full[key]
        if key in VOCAB_PARAMS:  # zero-pad the true vocabulary up to the padded size
            padded = src.new_zeros((param.shape[0] * (ctx.dims.tp if param.tensor_model_parallel else 1), src.shape[1]))
            padded[: src.shape[0]] = src
            src = padded
        if is_tp_sharded(param):
            src = _shard(src, param.partition_dim, ctx.dims.tp, ctx.tp_rank, is_glu_fc1(name, model))
        if src.shape != param.shape:
            raise ValueError(f"{key}: canonical shape {tuple(src.shape)} does not fit shard {tuple(param.shape)}.")
        param.copy_(src)


@torch.no_grad()
def gather_full_state_dict(model, ctx: ParallelContext, vocab_size: int) -> dict[str, torch.Tensor]:
    """The canonical state dict, complete on every rank (CPU tensors, fp32 kept as is)."""
    tied = model.share_embeddings_and_output_weights
    offset, experts = layer_offset(model), expert_offset(model, ctx)
    stage: dict[str, torch.Tensor] = {}
    own_experts: dict[str, torch.Tensor] = {}
    for name, param in local_params(model, tied):
        tensor = param.detach()
        if is_tp_sharded(param) and ctx.dims.tp > 1:
            parts = [torch.empty_like(tensor) for _ in range(ctx.dims.tp)]
            dist.all_gather(parts, tensor.contiguous(), group=ctx.pgs.tp)
            tensor = unshard(parts, param.partition_dim, is_glu_fc1(name, model))
        key = global_name(name, offset, experts)
        if key in VOCAB_PARAMS:
            tensor = tensor[:vocab_size]
        (own_experts if is_expert_param(param) else stage)[key] = tensor.cpu().clone()
    if ctx.dims.ep > 1:  # every expert-parallel rank of the stage holds other experts
        parts: list[dict] = [None] * ctx.dims.ep  # type: ignore[list-item]
        dist.all_gather_object(parts, own_experts, group=ctx.pgs.ep)
        for part in parts:
            stage.update(part)
    else:
        stage.update(own_experts)
    stages: list[dict] = [None] * ctx.dims.pp  # type: ignore[list-item]
    dist.all_gather_object(stages, stage, group=ctx.pgs.pp)
    full: dict[str, torch.Tensor] = {}
    for part in stages:
        full.update(part)
    return full
