"""Load dist checkpoints written by ``apriel-convert hf-to-mcore`` into Megatron at several layouts,
run a forward pass, and save Megatron's own TP=2 / PP=2 checkpoints for the export test.

Launched by tests/unit/convert/test_convert_checkpoint.py (and test_convert_moe.py) as
``torchrun --nproc_per_node N convert_parity.py SPEC.json OUT.pt``. SPEC: {"models": [{"name",
"ckpt", "arch"}...], "tokens": [[...]], "resave": {"name": ..., LAYOUT: dir, ...}, optional
"layouts": [[name, tp, pp, ep, sequence_parallel], ...] (default: LAYOUTS)}.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_apriel.model import ModelArch, ModelConfig, build_model
from megatron_apriel.parallel import ParallelConfig, destroy_parallel, init_parallel

LAYOUTS = (("tp2", 2, 1, 1, False), ("pp2", 1, 2, 1, False), ("tp1_dp2", 1, 1, 1, False))


def forward(model, ctx, tokens: torch.Tensor, arch: ModelArch):
    """Full-vocabulary logits [b, s, vocab] on the last stage (None elsewhere)."""
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    if ctx.dims.pp > 1:
        ranks = dist.get_process_group_ranks(ctx.pgs.pp)
        if ctx.is_first_stage:
            hidden = model(tokens, pos, None)
            dist.send(hidden.contiguous(), dst=ranks[ctx.pp_rank + 1])
            return None
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], arch.hidden_size)
        dist.recv(hidden, src=ranks[ctx.pp_rank - 1])
        model.set_input_tensor(hidden)
    logits = model(tokens, pos, None)
    if ctx.dims.tp > 1:
        parts = [torch.empty_like(logits) for _ in range(ctx.dims.tp)]
        dist.all_gather(parts, logits.contiguous(), group=ctx.pgs.tp)
        logits = torch.cat(parts, dim=-1)
    return logits[..., : arch.vocab_size]


def run(ckpt: str, arch: ModelArch, tokens, tp: int, pp: int, ep: int, sp: bool, resave_to: str | None):
    ctx = init_parallel(ParallelConfig(tp=tp, pp=pp, ep=ep, sequence_parallel=sp))
    model = build_model(ModelConfig(arch=arch), ctx).eval()
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
    model.load_state_dict(state)
    with torch.no_grad():
        logits = forward(model, ctx, tokens, arch)
    if resave_to:
        os.makedirs(resave_to, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), resave_to)
    keep = logits if (ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0) else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, keep)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return next(g for g in gathered if g is not None)


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    tokens = torch.tensor(spec["tokens"])
    results = {}
    for m in spec["models"]:
        arch = ModelArch(**m["arch"])
        for layout, tp, pp, ep, sp in spec.get("layouts", LAYOUTS):
            resave = spec["resave"].get(layout) if spec["resave"]["name"] == m["name"] else None
            results[(m["name"], layout)] = run(m["ckpt"], arch, tokens, tp, pp, ep, sp, resave)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    destroy_parallel()


if __name__ == "__main__":  # required: Megatron's checkpoint writer starts a spawn-context Manager
    main(sys.argv[1], sys.argv[2])
