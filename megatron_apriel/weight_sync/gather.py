"""What one trainer rank sends to the fleet: its share of its pipeline stage's weights in Hugging
Face form, gathered over TP one layer at a time.

Pure Megatron + torch.distributed (no vLLM). Canonical names (``model/state.py``: TP=1/PP=1/EP=1,
global layer and expert indices, unpadded vocabulary) are grouped per decoder layer (plus one group
before the layers: the embedding; one after: final norm and output layer) and handed to ``to_hf``,
the conversion table's per-group function, which returns ``(hf_name, tensor)`` pairs.

Who sends what (a *source* is one sending rank with its own process group to the fleet; the wire
protocol calls it a stage):
- a dense model: one source per pipeline stage, its (tp 0, dp 0) rank, which sends everything
  after gathering the TP shards with the other TP ranks of data-parallel replica 0;
- a mixture of experts: one source per (pipeline stage, expert-parallel rank), the rank holding
  those experts in expert-data-parallel replica 0. It sends its own experts, whole (expert TP is 1),
  without gathering them anywhere; the source that is also the stage's (tp 0, dp 0) rank sends the
  dense weights as well. A stage's experts thus leave from ``ep`` ranks at once.

``metadata()`` runs the same conversion on meta tensors, so the full HF layout (names, shapes,
dtypes) is known before a single byte is gathered.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_apriel.model.state import (
    VOCAB_PARAMS,
    expert_offset,
    global_name,
    is_expert_param,
    is_glu_fc1,
    is_tp_sharded,
    layer_offset,
    local_params,
    unshard,
)
from megatron_apriel.parallel.groups import ParallelContext

ToHF = Callable[[dict[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]
"""One group of canonical tensors -> HF (name, tensor) pairs (the conversion table, bound to the arch)."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _group_key(canonical: str) -> tuple[int, int]:
    m = _LAYER.match(canonical)
    if m:
        return (1, int(m.group(1)))
    return (0, 0) if canonical.startswith("embedding.") else (2, 0)


@dataclass(frozen=True)
class SourceRole:
    """This rank's part in a push."""

    source: int
    """Its source index (``pp_rank * ep + ep_rank``), or -1 when it sends nothing."""
    num_sources: int
    send_dense: bool
    """Sends the stage's dense (non-expert) weights: the (tp 0, cp 0, dp 0) rank."""
    send_experts: bool
    """Sends its own experts: a MoE model's expert-DP replica 0."""
    gather_dense: bool
    """Takes part in the dense TP gathers: data- and context-parallel replica 0."""

    @property
    def sends(self) -> bool:
        return self.source >= 0


def source_role(ctx: ParallelContext, moe: bool) -> SourceRole:
    replica0 = ctx.dp_rank == 0 and ctx.cp_rank == 0  # CP ranks hold the same weights, as DP replicas do
    send_dense = ctx.tp_rank == 0 and replica0
    send_experts = moe and ctx.expert_dp_rank == 0
    if send_dense and moe and not send_experts:
        raise RuntimeError(f"rank {ctx.rank} sends the dense weights (tp 0, dp 0) but holds expert-DP replica "
                           f"{ctx.expert_dp_rank} of its experts: this Megatron rank order is not supported.")
    ep = ctx.dims.ep if moe else 1
    sends = send_dense or send_experts
    return SourceRole(source=ctx.pp_rank * ep + (ctx.ep_rank if moe else 0) if sends else -1,
                      num_sources=ctx.dims.pp * ep, send_dense=send_dense, send_experts=send_experts,
                      gather_dense=replica0)


class StageWeights:
    """Iterates this rank's share of its stage in a fixed order, the same on every TP rank of the
    stage (so the dense TP gathers line up)."""

    def __init__(self, model, ctx: ParallelContext, vocab_size: int, to_hf: ToHF):
        self.model, self.ctx, self.vocab_size, self.to_hf = model, ctx, vocab_size, to_hf
        self.role = source_role(ctx, moe=bool(model.config.num_moe_experts))
        offset, experts = layer_offset(model), expert_offset(model, ctx)
        tied = model.share_embeddings_and_output_weights
        groups: dict[tuple[int, int], list[tuple[str, str, torch.nn.Parameter]]] = {}
        for local, param in local_params(model, tied):
            canonical = global_name(local, offset, experts)
            groups.setdefault(_group_key(canonical), []).append((local, canonical, param))
        self.groups = [groups[k] for k in sorted(groups)]

    def _sent(self, param) -> bool:
        return self.role.send_experts if is_expert_param(param) else self.role.send_dense

    def _full_shape(self, canonical: str, param) -> list[int]:
        shape = list(param.shape)
        if is_tp_sharded(param):
            shape[param.partition_dim] *= self.ctx.dims.tp
        if canonical in VOCAB_PARAMS:
            shape[0] = self.vocab_size
        return shape

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        out = []
        for group in self.groups:
            meta = {c: torch.empty(self._full_shape(c, p), dtype=p.dtype, device="meta")
                    for _, c, p in group if self._sent(p)}
            out += [(name, t.dtype, tuple(t.shape)) for name, t in self.to_hf(meta)]
        return out

    @torch.no_grad()
    def _gather(self, local: str, canonical: str, param) -> torch.Tensor:
        tensor = param.detach()
        if is_tp_sharded(param) and self.ctx.dims.tp > 1:
            tp, glu = self.ctx.dims.tp, is_glu_fc1(local, self.model)
            if param.partition_dim == 0 and not glu:  # the gather's output is the full tensor: no concat copy
                full = tensor.new_empty((tp * tensor.shape[0], *tensor.shape[1:]))
                dist.all_gather_into_tensor(full, tensor.contiguous(), group=self.ctx.pgs.tp)
                tensor = full
            else:
                parts = [torch.empty_like(tensor) for _ in range(tp)]
                dist.all_gather(parts, tensor.contiguous(), group=self.ctx.pgs.tp)
                tensor = unshard(parts, param.partition_dim, glu)
        if canonical in VOCAB_PARAMS:
            tensor = tensor[: self.vocab_size]
        return tensor

    def _group_tensors(self, group) -> dict[str, torch.Tensor]:
        """The group's tensors this rank sends, after taking part in its dense TP gathers."""
        out = {}
        for local, canonical, param in group:
            if is_expert_param(param):
                if self.role.send_experts:
                    out[canonical] = param.detach()
            elif self.role.gather_dense:
                tensor = self._gather(local, canonical, param)
                if self.role.send_dense:
                    out[canonical] = tensor
        return out

    def hf_tensors(self, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """Gather (a TP collective: every TP rank of replica 0 must iterate) and convert what this
        rank sends."""
        for group in self.groups:
            for name, tensor in self.to_hf(self._group_tensors(group)):
                yield name, tensor.to(device)

    def gather_only(self) -> None:
        """The dense TP collectives of ``hf_tensors`` (ranks of replica 0 that send nothing)."""
        for group in self.groups:
            self._group_tensors(group)


def table_to_hf(arch, layout=None) -> ToHF:
    """``ToHF`` from the conversion table (``convert.mapping``), renamed into the served checkpoint's
    key layout (plain causal LM by default; LLaVA-wrapped checkpoints such as Apriel need theirs)."""
    from megatron_apriel.convert.mapping import LAYOUTS, canonical_to_hf

    layout = layout or LAYOUTS["causal_lm"]
    return lambda group: [(layout.to_checkpoint(k), v) for k, v in canonical_to_hf(group, arch).items()]
