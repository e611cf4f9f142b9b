"""One GSPO optimizer step through Megatron's pipeline schedule (any TP/PP/DP layout)."""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megatron_apriel.model.head import emitting_hidden, head_in_fp32, head_weight
from megatron_apriel.model.routing import StageRouting, routing_metrics
from megatron_apriel.parallel.collectives import any_rank, reduce_metrics, sum_over_world
from megatron_apriel.parallel.groups import ParallelContext
from megatron_apriel.trainer.batch import MicroBatch
from megatron_apriel.trainer.config import LOGPROB_CHUNK_TOKENS, LossConfig
from megatron_apriel.trainer.logprobs import chunked_head_logprobs, vocab_parallel_logprobs
from megatron_apriel.trainer.loss import METRIC_REDUCTIONS, LossInputs, finalize_metrics, policy_loss
from megatron_apriel.trainer.mismatch import PER_SEQ_FRESH, fresh_drift_by_sequence, server_drift, server_routing


def forward_logits(model, mb: MicroBatch, routing: Optional[StageRouting] = None, ctx: Optional[ParallelContext] = None,
                   training: bool = False, hidden: bool = False):
    """Run one stage on a micro-batch: logits ``[b, S, V/tp]`` on the last stage (with ``hidden``:
    its last hidden states ``[b, S, h]``, whole on every TP rank), the stage's output otherwise.
    ``routing``: a MoE stage's taps, told this micro-batch's routing inputs first."""
    if routing is not None:
        routing.begin(routing=mb.routing, valid=mb.valid, fresh=mb.fresh, training=training,
                      tp=(ctx.dims.tp, ctx.tp_rank), seq=mb.seq, n_seq=len(mb.advantages))
    packed = mb.packed_seq_params()
    with emitting_hidden(model, hidden):
        return model(mb.tokens, mb.position_ids, None, packed_seq_params=packed)


def token_logprobs(output, mb: MicroBatch, ctx: ParallelContext, vocab_size: int, temperature: float, *,
                   model=None, chunk_tokens: int = 0):
    """``(logp, entropy)``, each ``[b, S]`` fp32, from the last stage's ``output``: its logits
    (``chunk_tokens=0``), or its hidden states, of which only the loss positions go through the
    output weight of ``model``, ``chunk_tokens`` at a time (zeros elsewhere)."""
    tp_group = ctx.pgs.tp if ctx.dims.tp > 1 else None
    if not chunk_tokens:
        return vocab_parallel_logprobs(output, mb.labels, vocab_size=vocab_size, temperature=temperature,
                                       tp_group=tp_group, tp_rank=ctx.tp_rank)
    where = mb.loss_mask  # [b, S]
    logp_n, entropy_n = chunked_head_logprobs(
        output[where], head_weight(model), mb.labels[where], vocab_size=vocab_size, chunk_tokens=chunk_tokens,
        temperature=temperature, compute_dtype=torch.float32 if head_in_fp32(model) else None,
        tp_group=tp_group, tp_rank=ctx.tp_rank)
    zeros = torch.zeros(where.shape, dtype=torch.float32, device=output.device)
    return zeros.masked_scatter(where, logp_n), zeros.masked_scatter(where, entropy_n)


def _loss_func(mb: MicroBatch, ctx, cfg: LossConfig, vocab_size: int, model, chunk_tokens: int, output):
    logp, entropy = token_logprobs(output, mb, ctx, vocab_size, cfg.temperature, model=model,
                                   chunk_tokens=chunk_tokens)
    inp = LossInputs(logp.flatten(), mb.old_logp.flatten(), mb.loss_mask.flatten(), mb.seq.flatten(),
                     mb.advantages, mb.truncated, entropy.flatten(), mb.fresh.flatten(), mb.lag.flatten(),
                     mb.stale_cache.flatten(), seq_total=_sum_over_cp(ctx), counts_sequences=ctx.cp_rank == 0)
    out = policy_loss(inp, cfg)
    metrics = dict(out.metrics, loss_sum=out.loss_sum.detach(), count=out.count.detach().float(),
                   nonfinite=(~torch.isfinite(out.loss_sum.detach())).float())
    metrics[PER_SEQ_FRESH] = fresh_drift_by_sequence(inp)  # on the device: read once, after the schedule
    return out.loss_sum, out.count, metrics


def _sum_over_cp(ctx: ParallelContext):
    """Sums a per-sequence tensor over the CP group (whose ranks hold parts of the same sequences)."""
    if ctx.dims.cp == 1:
        return None

    def total(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=ctx.pgs.cp)
        return t

    return total


def _forward_step(ctx, cfg, vocab_size, routing, chunk_tokens, data_iterator, model):
    mb = next(data_iterator).to(ctx.device)
    output = forward_logits(model, mb, routing, ctx, training=True, hidden=chunk_tokens > 0)
    return output, partial(_loss_func, mb, ctx, cfg, vocab_size, model, chunk_tokens)


def _schedule(chunks, ctx: ParallelContext):
    """Megatron's forward/backward schedule for this layout, with our groups bound in."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    kwargs = {"pg_collection": ctx.pgs}
    if ctx.dims.pp > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=ctx.pgs.pp, config=chunks[0].config)
    return partial(get_forward_backward_func(pp_size=ctx.dims.pp, vp_size=None), **kwargs)


class NonFiniteError(FloatingPointError):
    """A loss or gradient was NaN/Inf: the step was not applied (``microbatches``: where, if known)."""

    def __init__(self, what: str, microbatches: list[int]):
        super().__init__(f"non-finite {what}" + (f" in micro-batch(es) {microbatches}" if microbatches else ""))
        self.what, self.microbatches = what, microbatches


def train_step(chunks, microbatches: list[MicroBatch], *, optimizer, scheduler, ctx: ParallelContext,
               cfg: LossConfig, vocab_size: int, routing: Optional[StageRouting] = None,
               logprob_chunk_tokens: int = LOGPROB_CHUNK_TOKENS) -> dict:
    """Forward/backward all micro-batches, reduce gradients, clip, step. Returns logged metrics
    (complete on the last pipeline stage; ``{}``-like on the others, plus the grad norm).
    ``routing``: the stage's MoE routing taps (None for a dense model): replay and counts.
    ``logprob_chunk_tokens``: ``trainer.logprob_chunk_tokens`` (0: from the full logits)."""
    if not microbatches:
        raise ValueError("train_step got no micro-batches: every data-parallel rank needs at least one sample.")
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    shape = microbatches[0].tokens.shape
    per_mb = _schedule(chunks, ctx)(
        forward_step_func=partial(_forward_step, ctx, cfg, vocab_size, routing, logprob_chunk_tokens),
        data_iterator=iter(microbatches),
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=shape[1] * ctx.dims.cp,  # the whole row: Megatron divides by cp
        micro_batch_size=shape[0],
        forward_only=False,
    )
    bad = [i for i, m in enumerate(per_mb) if m["nonfinite"] > 0] if ctx.is_last_stage else []
    if any_rank(bool(bad)):  # every rank stops before the optimizer touches a weight
        raise NonFiniteError("loss", bad)
    lr = optimizer.param_groups[0]["lr"]  # the step's own (the scheduler's step below sets the next one)
    success, grad_norm, _ = optimizer.step()
    if not success:  # Megatron found Inf/NaN gradients on some rank and skipped the update everywhere
        raise NonFiniteError("gradients", [])
    scheduler.step(increment=1)
    metrics = {"train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "train/lr": lr}
    if routing is not None:
        metrics.update(server_routing(routing.take_sequence_counts(), microbatches))
        metrics.update(routing_metrics(sum_over_world(routing.take_counts()), chunks[0].config.moe_router_topk))
    if ctx.is_last_stage:
        # CP ranks hold parts of the same sequences: their sums add up like DP ranks'
        group = ctx.pgs.dp_cp if ctx.dims.dp * ctx.dims.cp > 1 else None
        metrics.update(server_drift(per_mb, microbatches, group))
        totals = reduce_metrics(per_mb, METRIC_REDUCTIONS, group)
        metrics.update(finalize_metrics(totals))
        metrics["train/loss"] = totals["loss_sum"] / max(totals["count"], 1.0)
    return metrics


@torch.no_grad()
def forward_logprobs(chunks, microbatches: list[MicroBatch], *, ctx: ParallelContext, vocab_size: int,
                     temperature: float, routing: Optional[StageRouting] = None,
                     logprob_chunk_tokens: int = LOGPROB_CHUNK_TOKENS) -> list[torch.Tensor]:
    """Per-token log-probs ``[b, S]`` of each micro-batch (last stage; empty list elsewhere), at the
    loss positions (every position with ``logprob_chunk_tokens=0``)."""
    shape = microbatches[0].tokens.shape

    def step(data_iterator, model):
        mb = next(data_iterator).to(ctx.device)

        def collect(output):
            logp, _ = token_logprobs(output, mb, ctx, vocab_size, temperature, model=model,
                                     chunk_tokens=logprob_chunk_tokens)
            return logp.sum() * 0, torch.tensor(1, dtype=torch.int), {"logp": logp.detach().cpu()}

        return forward_logits(model, mb, routing, ctx, hidden=logprob_chunk_tokens > 0), collect

    out = _schedule(chunks, ctx)(
        forward_step_func=step, data_iterator=iter(microbatches), model=chunks,
        num_microbatches=len(microbatches), micro_batch_size=shape[0],
        seq_length=shape[1] * ctx.dims.cp,  # the whole row: Megatron divides by cp
        forward_only=True,
    )
    if routing is not None:
        routing.end()
    return [d["logp"] for d in out] if ctx.is_last_stage else []
