"""Run the same tiny model and batch under several (tp, pp, dp) layouts; save what each computed.

Launched by tests/unit/trainer/test_layouts.py as ``torchrun --nproc_per_node 2 layouts.py OUT``.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist

from megatron_apriel.convert.mapping import canonical_shapes
from megatron_apriel.model import ModelArch, ModelConfig, build_model
from megatron_apriel.model.config import OptimConfig
from megatron_apriel.model.state import gather_full_state_dict, load_full_state_dict
from megatron_apriel.model.wrap import build_optimizer, wrap_model
from megatron_apriel.parallel import ParallelConfig, destroy_parallel, init_parallel
from megatron_apriel.parallel.context import cp_positions
from megatron_apriel.parallel.dims import cp_alignment
from megatron_apriel.trainer.batch import (TrainSample, cp_shard, packed_microbatches, padded_microbatches,
                                           split_for_data_parallel)
from megatron_apriel.trainer.config import LossConfig
from megatron_apriel.trainer.step import forward_logprobs, train_step

ARCH = ModelArch(family="qwen2", vocab_size=250, hidden_size=64, ffn_hidden_size=96, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=24, qkv_bias=True, tie_embeddings=False)
TIED = dataclasses.replace(ARCH, tie_embeddings=True)
CHUNK = 5  # tokens of logits at a time: chunks straddle sequences and packed rows (completions of 5-17 tokens)
SEQ_LEN = 48
# A large Adam epsilon keeps the update from amplifying float round-off in near-zero gradients,
# so that layouts can be compared at 1e-5 after one step while the weights still move by ~lr.
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, clip_grad=1.0, adam_eps=1e-3)
GSPO = LossConfig(kind="gspo", eps_low=0.2, eps_high=0.2, temperature=0.9)
DAPO = LossConfig(kind="grpo", aggregation="token_mean", eps_low=0.2, eps_high=0.28)
# bounds inside this case's spread of rho (0.05 to 0.95: the random weights are not the behaviour policy),
# so that each correction keeps some tokens and sequences and cuts others
# (seq_mask on the default anchor, the ratio against mu with GSPO's clip; token_mask on the step's own weights)
SEQ_MASK = dataclasses.replace(GSPO, correction="seq_mask", correction_seq_low=0.2, correction_seq_high=2.0,
                               correction_clip=0.5)
TOKEN_MASK = dataclasses.replace(DAPO, correction="token_mask", correction_anchor="current", correction_low=0.1)


def reference_state(model_full_names) -> dict:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(shape, generator=g) * 0.1 for k, shape in model_full_names}


def multi_turn_mask(i: int, clen: int) -> torch.Tensor:
    """Odd samples are multi-turn: after 2 model tokens, 1 to 3 environment tokens (a tool turn), and
    in the longer ones a second environment turn 5 tokens from the end; each ends with a model turn."""
    mask = torch.ones(clen, dtype=torch.bool)
    if i % 2:
        mask[2 : 3 + i % 3] = False
        if clen >= 12:
            mask[clen - 5 : clen - 3] = False
    return mask


def samples() -> list[TrainSample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(8):
        plen = 3 + i % 4
        clen = 5 + (7 * i) % 13
        toks = torch.randint(0, ARCH.vocab_size, (plen + clen,), generator=g).tolist()
        mask = multi_turn_mask(i, clen)
        old = (-torch.rand(clen, generator=g) * 3 - 2.5)[mask].tolist()  # per model token
        lags = [(i + k) % 3 for k in range(len(old))]  # fresh and stale tokens, for the mismatch figures
        out.append(TrainSample(toks, plen, old, advantage=float(torch.randn((), generator=g)), truncated=(i == 5),
                               lags=lags, server=f"http://10.0.0.{i % 3}:8000",
                               mask=None if mask.all() else mask.numpy()))
    return out


def run_layout(tp, pp, packed, loss_cfg, sp=False, chunk=CHUNK, arch=ARCH, cp=1):
    """Load the reference weights into (tp, cp, pp, dp = 2 / (tp * cp * pp)), run log-probs and one
    step (``sp``: with sequence parallelism; ``chunk``: trainer.logprob_chunk_tokens, 0 for full
    logits; ``cp``: context parallelism, packed rows split as the trainer splits them)."""
    ctx = init_parallel(ParallelConfig(tp=tp, pp=pp, cp=cp, sequence_parallel=sp))
    model = build_model(ModelConfig(arch=arch), ctx)
    ref = reference_state(sorted(canonical_shapes(arch).items()))
    load_full_state_dict(model, ref, ctx)
    chunks = wrap_model(model, ctx)
    optimizer, scheduler = build_optimizer(chunks, OPTIM, ctx, total_steps=10)
    mine, ids = split_for_data_parallel(samples(), ctx.dims.dp, ctx.dp_rank)
    if packed:
        align = cp_alignment(cp, tp, sp)
        mbs = [cp_shard(mb, cp, ctx.cp_rank) for mb in packed_microbatches(mine, ids, SEQ_LEN, align=align)]
    else:
        mbs = padded_microbatches(mine, ids, 3, SEQ_LEN)
    logp = forward_logprobs(chunks, mbs, ctx=ctx, vocab_size=arch.vocab_size, temperature=loss_cfg.temperature,
                            logprob_chunk_tokens=chunk)
    per_token = {}  # (sample, position in the row) -> log-prob: CP ranks hold different positions
    for mb, lp in zip(mbs, logp):
        where = cp_positions(mb.cu_seqlens, cp, ctx.cp_rank) if cp > 1 else torch.arange(mb.tokens.shape[1])
        for j, sid in enumerate(mb.sample_ids):
            rows, cols = (mb.loss_mask & (mb.seq == j)).nonzero(as_tuple=True)
            per_token.update({(sid, int(where[c])): lp[r, c] for r, c in zip(rows.tolist(), cols.tolist())})
    metrics = train_step(chunks, mbs, optimizer=optimizer, scheduler=scheduler, ctx=ctx, cfg=loss_cfg,
                         vocab_size=arch.vocab_size, logprob_chunk_tokens=chunk)
    full = gather_full_state_dict(model, ctx, arch.vocab_size)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_token)
    merged = {k: v for d in gathered for k, v in d.items()}
    all_logp = {sid: torch.stack([merged[k] for k in sorted(k for k in merged if k[0] == sid)])
                for sid in {k[0] for k in merged}}
    all_metrics = [None] * dist.get_world_size()
    dist.all_gather_object(all_metrics, metrics if ctx.is_logging_rank else None)
    destroy_parallel_groups_only()
    return {"logp": all_logp, "metrics": [m for m in all_metrics if m][0], "weights": full}


def destroy_parallel_groups_only():
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def main(out_path):
    runs = [("gspo/tp1_dp2", 1, 1, False, GSPO), ("gspo/tp2", 2, 1, False, GSPO), ("gspo/pp2", 1, 2, False, GSPO),
            ("gspo/tp1_dp2_packed", 1, 1, True, GSPO), ("gspo/tp2_packed", 2, 1, True, GSPO),
            ("gspo/pp2_packed", 1, 2, True, GSPO), ("dapo/tp1_dp2", 1, 1, False, DAPO), ("dapo/pp2_packed", 1, 2, True, DAPO)]
    runs += [("gspo/tp2_sp", 2, 1, False, GSPO, True), ("gspo/tp2_sp_packed", 2, 1, True, GSPO, True)]
    # The full-logits path (trainer.logprob_chunk_tokens=0) beside the chunked one, untied and tied
    runs += [("full/tp1_dp2", 1, 1, False, GSPO, False, 0), ("full/tp2_packed", 2, 1, True, GSPO, False, 0),
             ("full/tp2_sp", 2, 1, False, GSPO, True, 0), ("full/pp2_packed", 1, 2, True, GSPO, False, 0)]
    runs += [("tied/tp1_dp2_packed", 1, 1, True, GSPO, False, CHUNK, TIED),
             ("tied/tp2", 2, 1, False, GSPO, False, CHUNK, TIED), ("tied/pp2", 1, 2, False, GSPO, False, CHUNK, TIED),
             ("tied_full/tp1_dp2_packed", 1, 1, True, GSPO, False, 0, TIED),
             ("tied_full/tp2", 2, 1, False, GSPO, False, 0, TIED), ("tied_full/pp2", 1, 2, False, GSPO, False, 0, TIED)]
    # Context parallelism: each packed sequence split into 4 chunks over the 2 ranks (dp 1)
    runs += [("cp/cp2_packed", 1, 1, True, GSPO, False, CHUNK, ARCH, 2),
             ("cp/cp2_packed_full", 1, 1, True, GSPO, False, 0, ARCH, 2),
             ("cp/cp2_packed_dapo", 1, 1, True, DAPO, False, CHUNK, ARCH, 2)]
    # Mismatch corrections: sequence-level (sums over CP ranks) and token-level
    runs += [("seqmask/tp1_dp2", 1, 1, False, SEQ_MASK), ("seqmask/tp2", 2, 1, False, SEQ_MASK),
             ("seqmask/pp2", 1, 2, False, SEQ_MASK), ("seqmask/tp1_dp2_packed", 1, 1, True, SEQ_MASK),
             ("seqmask/cp2_packed", 1, 1, True, SEQ_MASK, False, CHUNK, ARCH, 2),
             ("tokmask/tp1_dp2", 1, 1, False, TOKEN_MASK), ("tokmask/pp2_packed", 1, 2, True, TOKEN_MASK)]
    results = {"initial": reference_state(sorted(canonical_shapes(ARCH).items())),
               "initial_tied": reference_state(sorted(canonical_shapes(TIED).items()))}
    for name, *layout in runs:
        results[name] = run_layout(*layout)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1])
