"""This pipeline stage's weights in Hugging Face form, gathered over TP one layer at a time.

Pure Megatron + torch.distributed (no vLLM). Canonical names (``model/state.py``: TP=1/PP=1,
global layer indices, unpadded vocabulary) are grouped per decoder layer (plus one group before
the layers: the embedding; one after: final norm and output layer) and handed to ``to_hf``, the
conversion table's per-group function, which returns ``(hf_name, tensor)`` pairs.

``metadata()`` runs the same conversion on meta tensors, so the full HF layout (names, shapes,
dtypes) is known, and can be broadcast, before a single byte is gathered.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_apriel.model.state import VOCAB_PARAMS, is_glu_fc1, local_params, unshard, global_name, layer_offset
from megatron_apriel.parallel.groups import ParallelContext

ToHF = Callable[[dict[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]
"""One group of canonical tensors -> HF (name, tensor) pairs (the conversion table, bound to the arch)."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _group_key(canonical: str) -> tuple[int, int]:
    m = _LAYER.match(canonical)
    if m:
        return (1, int(m.group(1)))
    return (0, 0) if canonical.startswith("embedding.") else (2, 0)


class StageWeights:
    """Iterates this rank's stage in a fixed order: the same on every TP rank of the stage."""

    def __init__(self, model, ctx: ParallelContext, vocab_size: int, to_hf: ToHF):
        self.model, self.ctx, self.vocab_size, self.to_hf = model, ctx, vocab_size, to_hf
        offset = layer_offset(model)
        tied = model.share_embeddings_and_output_weights
        groups: dict[tuple[int, int], list[tuple[str, str, torch.nn.Parameter]]] = {}
        for local, param in local_params(model, tied):
            canonical = global_name(local, offset)
            groups.setdefault(_group_key(canonical), []).append((local, canonical, param))
        self.groups = [groups[k] for k in sorted(groups)]

    def _full_shape(self, local: str, canonical: str, param) -> list[int]:
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= self.ctx.dims.tp
        if canonical in VOCAB_PARAMS:
            shape[0] = self.vocab_size
        return shape

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        out = []
        for group in self.groups:
            meta = {c: torch.empty(self._full_shape(l, c, p), dtype=p.dtype, device="meta") for l, c, p in group}
            out += [(name, t.dtype, tuple(t.shape)) for name, t in self.to_hf(meta)]
        return out

    @torch.no_grad()
    def _gather(self, local: str, canonical: str, param) -> torch.Tensor:
        tensor = param.detach()
        if getattr(param, "tensor_model_parallel", False) and self.ctx.dims.tp > 1:
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

    def hf_tensors(self, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """Gather (a TP collective: every TP rank of the stage must iterate) and convert."""
        for group in self.groups:
            canonical = {c: self._gather(l, c, p) for l, c, p in group}
            for name, tensor in self.to_hf(canonical):
                yield name, tensor.to(device)

    def gather_only(self) -> None:
        """The TP collectives of ``hf_tensors`` without the conversion (non-sending TP ranks)."""
        for group in self.groups:
            for local, canonical, param in group:
                self._gather(local, canonical, param)


def table_to_hf(arch, layout=None) -> ToHF:
    """``ToHF`` from the conversion table (``convert.mapping``), renamed into the served checkpoint's
    key layout (plain causal LM by default; LLaVA-wrapped checkpoints such as Apriel need theirs)."""
    from megatron_apriel.convert.mapping import LAYOUTS, canonical_to_hf

    layout = layout or LAYOUTS["causal_lm"]
    return lambda group: [(layout.to_checkpoint(k), v) for k, v in canonical_to_hf(group, arch).items()]
