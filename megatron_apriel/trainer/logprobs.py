"""Token log-probabilities from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for a contiguous slice of the (padded) vocabulary. The
log-softmax normaliser and the target logit are reduced across the TP group; the backward pass
uses the saved softmax, so memory is one fp32 copy of the local logits (as Megatron's own
vocab-parallel cross entropy). Logits are divided by the sampling temperature first, so the
result is comparable to the processed log-probs vLLM returns; rows of the padded vocabulary
(index >= true vocab size) are excluded from the softmax, as vLLM never samples them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_start, vocab_size, group):
        # logits: [..., V_local] (any float dtype), targets: [...] (global token ids)
        x = logits.float() / temperature
        v_local = x.shape[-1]
        n_pad = max(0, vocab_start + v_local - vocab_size)
        if n_pad:
            x[..., v_local - n_pad :] = float("-inf")
        with torch.no_grad():
            x_max = x.max(dim=-1, keepdim=True).values
            if group is not None:
                dist.all_reduce(x_max, op=dist.ReduceOp.MAX, group=group)
        x = x - x_max
        local = targets - vocab_start
        in_range = (local >= 0) & (local < v_local)
        target_logit = torch.where(
            in_range, x.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1), torch.zeros_like(x[..., 0])
        )
        p = x.exp()  # unnormalised softmax, reused below and saved for backward
        sum_exp = p.sum(-1)
        # sum p*x for the entropy; -inf * 0 on masked pad columns is avoided by masking first
        px = torch.where(p > 0, p * x, torch.zeros_like(p)).sum(-1)
        stacked = torch.stack([target_logit, sum_exp, px])
        if group is not None:
            dist.all_reduce(stacked, group=group)
        target_logit, sum_exp, px = stacked.unbind(0)
        log_z = sum_exp.log()
        logp = target_logit - log_z
        entropy = log_z - px / sum_exp
        p.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(p, local, in_range)
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        p, local, in_range = ctx.saved_tensors
        # d logp / d x_v = 1[v == target] - p_v, then the 1/temperature of the scaling
        grad = p.neg_()
        onehot_rows = grad.gather(-1, local.clamp(0, grad.shape[-1] - 1).unsqueeze(-1))
        grad.scatter_(-1, local.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), onehot_rows + in_range.unsqueeze(-1).to(grad.dtype))
        grad.mul_((grad_logp / ctx.temperature).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    tp_group=None,
    tp_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of each predictive distribution.

    Args:
        logits: ``[B, S, V/tp]`` this rank's slice of the padded vocabulary.
        targets: ``[B, S]`` int64 token ids (global ids; any value for masked positions).
        vocab_size: true vocabulary size; padded columns are excluded.
        temperature: logits are divided by it (the sampling temperature).
        tp_group: tensor-parallel group, or None when the logits hold the whole vocabulary.
        tp_rank: this rank's index in the TP group (its slice starts at ``tp_rank * V/tp``).
    Returns:
        ``(logp [B, S] fp32, differentiable; entropy [B, S] fp32, no gradient)``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    vocab_start = tp_rank * logits.shape[-1]
    return _VocabParallelLogProb.apply(logits, targets, float(temperature), vocab_start, vocab_size, tp_group)
