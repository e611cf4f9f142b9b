"""Run one tiny mixture-of-experts model and batch under several (tp, pp, ep, dp) layouts; save what
each computed: per-sample log-probs, one GSPO step's metrics and the updated weights. The samples
carry routed experts (random, as if another engine had chosen them); every layout replays them but
one, which routes freely.

Launched by tests/unit/trainer/test_moe_layouts.py as ``torchrun --nproc_per_node 4 moe_layouts.py
FAMILY OUT`` (gloo, real Megatron-Core, SequentialMLP experts, the allgather token dispatcher).
"""

import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_apriel.convert.mapping import canonical_shapes
from megatron_apriel.model import ModelArch, ModelConfig, build_model
from megatron_apriel.model.config import OptimConfig
from megatron_apriel.model.routing import StageRouting
from megatron_apriel.model.state import gather_full_state_dict, load_full_state_dict
from megatron_apriel.model.wrap import build_optimizer, wrap_model
from megatron_apriel.parallel import ParallelConfig, destroy_parallel, init_parallel
from megatron_apriel.parallel.context import cp_positions
from megatron_apriel.parallel.dims import cp_alignment
from megatron_apriel.trainer.batch import (TrainSample, cp_shard, packed_microbatches, padded_microbatches,
                                           split_for_data_parallel)
from megatron_apriel.trainer.config import LossConfig
from megatron_apriel.trainer.step import forward_logprobs, train_step
from megatron_apriel.weight_sync.gather import StageWeights, table_to_hf

ARCHS = {
    # a dense layer among sparse ones (Qwen3-MoE's mlp_only_layers), renormalised top-2 of 4 experts
    "qwen3_moe": ModelArch(family="qwen3_moe", vocab_size=250, hidden_size=64, ffn_hidden_size=96, num_layers=4,
                           num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, num_experts=4, moe_top_k=2,
                           moe_ffn_hidden_size=32, norm_topk_prob=True, dense_layers=[1]),
    # every layer sparse (stacked checkpoint keys), Mixtral's routing
    "mixtral": ModelArch(family="mixtral", vocab_size=250, hidden_size=64, ffn_hidden_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48),
}
SEQ_LEN = 48
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, clip_grad=1.0, adam_eps=1e-3)
GSPO = LossConfig(kind="gspo", eps_low=0.2, eps_high=0.2, temperature=0.9)
LAYOUTS = (  # name, tp, pp, ep, packed, replay, logprob chunk[, cp] (4 ranks: dp = 4 / (tp * cp * pp); tp 2 runs SP)
    ("ep1", 1, 1, 1, False, True, 5), ("ep1_free", 1, 1, 1, False, False, 5), ("ep2", 1, 1, 2, False, True, 5),
    ("ep4", 1, 1, 4, False, True, 5), ("ep2_tp2", 2, 1, 2, False, True, 5), ("ep2_pp2", 1, 2, 2, False, True, 5),
    ("ep2_packed", 1, 1, 2, True, True, 5), ("ep2_tp2_packed", 2, 1, 2, True, True, 5),
    ("ep2_tp2_packed_full_logits", 2, 1, 2, True, True, 0),  # the full-logits path, for comparison
    # context parallelism (packed rows in 4 chunks over 2 CP ranks), with EP, TP (sequence-parallel) and PP
    ("ep2_cp2_packed", 1, 1, 2, True, True, 5, 2), ("ep2_tp2_cp2_packed", 2, 1, 2, True, True, 5, 2),
    ("ep2_pp2_cp2_packed", 1, 2, 2, True, True, 5, 2),
)


def reference_state(arch: ModelArch) -> dict:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(shape, generator=g) * 0.1 for k, shape in sorted(canonical_shapes(arch).items())}


def routed_experts(arch: ModelArch, n: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, moe_layers, k]`` distinct random experts per token; the last token unrouted (-1), as vLLM
    never runs the token it sampled last."""
    layers = len(arch.moe_layers)
    out = np.stack([rng.permutation(arch.num_experts)[: arch.moe_top_k] for _ in range(n * layers)])
    out = out.reshape(n, layers, arch.moe_top_k).astype(np.int16)
    out[-1] = -1
    return out


SERVERS = ("http://10.0.0.1:8000", "http://10.0.0.2:8001")
"""The servers the samples say generated them (samples 0, 2, 3, 5, 6 the first; 1, 4, 7 the second)."""


def samples(arch: ModelArch) -> list[TrainSample]:
    g = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(2)
    out = []
    for i in range(8):
        plen, clen = 3 + i % 4, 5 + (7 * i) % 13
        toks = torch.randint(0, arch.vocab_size, (plen + clen,), generator=g).tolist()
        old = (-torch.rand(clen, generator=g) * 3 - 2.5).tolist()
        out.append(TrainSample(toks, plen, old, advantage=float(torch.randn((), generator=g)), truncated=(i == 5),
                               routing=routed_experts(arch, plen + clen, rng), server=SERVERS[i % 3 % 2]))
    return out


def run_layout(arch: ModelArch, tp: int, pp: int, ep: int, packed: bool, replay: bool, chunk: int, cp: int = 1) -> dict:
    ctx = init_parallel(ParallelConfig(tp=tp, pp=pp, ep=ep, cp=cp, sequence_parallel=tp > 1))
    model = build_model(ModelConfig(arch=arch), ctx)
    load_full_state_dict(model, reference_state(arch), ctx)
    routing = StageRouting(model, moe_layers=arch.moe_layers, num_experts=arch.num_experts, replay=replay)
    chunks = wrap_model(model, ctx)
    optimizer, scheduler = build_optimizer(chunks, OPTIM, ctx, total_steps=10)
    mine, ids = split_for_data_parallel(samples(arch), ctx.dims.dp, ctx.dp_rank)
    if packed:
        align = cp_alignment(cp, tp, tp > 1)
        mbs = [cp_shard(mb, cp, ctx.cp_rank) for mb in packed_microbatches(mine, ids, SEQ_LEN, align=align)]
    else:
        mbs = padded_microbatches(mine, ids, 2, SEQ_LEN)
    logp = forward_logprobs(chunks, mbs, ctx=ctx, vocab_size=arch.vocab_size, temperature=GSPO.temperature,
                            routing=routing, logprob_chunk_tokens=chunk)
    per_token = {}  # (sample, position in the row) -> log-prob: CP ranks hold different positions
    for mb, lp in zip(mbs, logp):
        where = cp_positions(mb.cu_seqlens, cp, ctx.cp_rank) if cp > 1 else torch.arange(mb.tokens.shape[1])
        for j, sid in enumerate(mb.sample_ids):
            rows, cols = (mb.loss_mask & (mb.seq == j)).nonzero(as_tuple=True)
            per_token.update({(sid, int(where[c])): lp[r, c] for r, c in zip(rows.tolist(), cols.tolist())})
    metrics = train_step(chunks, mbs, optimizer=optimizer, scheduler=scheduler, ctx=ctx, cfg=GSPO,
                         vocab_size=arch.vocab_size, routing=routing, logprob_chunk_tokens=chunk)
    full = gather_full_state_dict(model, ctx, arch.vocab_size)
    weights = StageWeights(model, ctx, arch.vocab_size, table_to_hf(arch))
    sent = {}
    if weights.role.sends:
        sent = {name: t.clone() for name, t in weights.hf_tensors(torch.device("cpu"))}
        assert [(n, tuple(t.shape)) for n, t in sent.items()] == [(n, s) for n, _, s in weights.metadata()]
    elif weights.role.gather_dense:
        weights.gather_only()
    sources = [None] * dist.get_world_size()
    dist.all_gather_object(sources, {"source": weights.role.source, "num_sources": weights.role.num_sources,
                                     "ep_rank": ctx.ep_rank, "pp_rank": ctx.pp_rank, "tensors": sent})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_token)
    merged = {k: v for d in gathered for k, v in d.items()}
    all_metrics = [None] * dist.get_world_size()
    dist.all_gather_object(all_metrics, metrics if ctx.is_logging_rank else None)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    logp_per_sample = {sid: torch.stack([merged[k] for k in sorted(k for k in merged if k[0] == sid)])
                       for sid in {k[0] for k in merged}}
    return {"logp": logp_per_sample, "metrics": next(m for m in all_metrics if m),
            "weights": full, "sources": sources}


def main(family: str, out_path: str) -> None:
    arch = ARCHS[family]
    results = {"initial": reference_state(arch)}
    for name, *layout in LAYOUTS:
        results[name] = run_layout(arch, *layout)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
