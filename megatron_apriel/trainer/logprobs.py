"""Token log-probabilities from vocabulary-parallel logits, without gathering the vocabulary.

Two paths, the same results to fp32 rounding:
- :func:`chunked_head_logprobs` (the default, ``trainer.logprob_chunk_tokens`` > 0): from the last
  hidden states of the loss positions and the output weight, ``chunk`` tokens at a time, the
  backward recomputing each chunk: the logits never exist for more than one chunk;
- :func:`vocab_parallel_logprobs` (``trainer.logprob_chunk_tokens=0``): from the full logits the
  output layer made for every position, the softmax saved for backward.

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
        grad.scatter_(-1, local.clamp(0, grad.shape[-1] - 1).unsqueeze(-1),
                      onehot_rows + in_range.unsqueeze(-1).to(grad.dtype))
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


def _scaled_logits(hidden, weight, temperature: float, vocab_start: int, vocab_size: int, compute_dtype):
    """``[n, V/tp]`` fp32 logits / temperature of one chunk, padded vocabulary rows at -inf: the
    matmul in ``compute_dtype`` (the output layer's), then fp32, as the full-logits path does."""
    x = torch.nn.functional.linear(hidden.to(compute_dtype), weight).float().div_(temperature)
    n_pad = _n_pad(x, vocab_start, vocab_size)
    if n_pad:
        x[:, x.shape[-1] - n_pad:] = float("-inf")
    return x


def _n_pad(x, vocab_start: int, vocab_size: int) -> int:
    return max(0, vocab_start + x.shape[-1] - vocab_size)


class _ChunkedHeadLogProb(torch.autograd.Function):
    """Log-probs and entropies from hidden states and the output weight, ``chunk`` tokens at a time;
    the backward recomputes each chunk's logits. Peak extra memory: a few ``[chunk, V/tp]`` fp32
    tensors and the weight's fp32 gradient accumulator, whatever the number of tokens."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_start, vocab_size, chunk, compute_dtype, group):
        # hidden: [N, h], weight: [V/tp, h], targets: [N] global ids
        w = weight.to(compute_dtype)
        n = hidden.shape[0]
        logp, entropy, log_z = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
        for s in range(0, n, chunk):
            x = _scaled_logits(hidden[s:s + chunk], w, temperature, vocab_start, vocab_size, compute_dtype)
            x_max = x.max(dim=-1).values
            if group is not None:
                dist.all_reduce(x_max, op=dist.ReduceOp.MAX, group=group)
            x.sub_(x_max.unsqueeze(-1))
            local = targets[s:s + chunk] - vocab_start
            in_range = (local >= 0) & (local < x.shape[-1])
            target = torch.where(in_range, x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1),
                                 torch.zeros_like(x_max))
            p = x.exp()
            sum_exp = p.sum(-1)
            n_pad = _n_pad(x, vocab_start, vocab_size)
            if n_pad:  # p is 0 there: p * x must be too, not 0 * -inf
                x[:, x.shape[-1] - n_pad:] = 0.0
            px = p.mul_(x).sum(-1)  # two [chunk, V/tp] fp32 tensors at most, in forward as in backward
            del p, x
            stacked = torch.stack([target, sum_exp, px])
            if group is not None:
                dist.all_reduce(stacked, group=group)
            target, sum_exp, px = stacked.unbind(0)
            lz = sum_exp.log()
            logp[s:s + chunk] = target - lz
            entropy[s:s + chunk] = lz - px / sum_exp
            log_z[s:s + chunk] = lz + x_max
        ctx.save_for_backward(hidden, weight, targets, log_z)
        ctx.args = (temperature, vocab_start, vocab_size, chunk, compute_dtype)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, log_z = ctx.saved_tensors
        temperature, vocab_start, vocab_size, chunk, compute_dtype = ctx.args
        w = weight.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk].to(compute_dtype)
            x = _scaled_logits(h, w, temperature, vocab_start, vocab_size, compute_dtype)
            # d logp / d x_v = 1[v == target] - p_v, times the 1/temperature of the scaling
            grad = x.sub_(log_z[s:s + chunk].unsqueeze(-1)).exp_().neg_()
            local = targets[s:s + chunk] - vocab_start
            in_range = (local >= 0) & (local < grad.shape[-1])
            idx = local.clamp(0, grad.shape[-1] - 1).unsqueeze(-1)
            grad.scatter_add_(-1, idx, in_range.to(grad.dtype).unsqueeze(-1))
            grad = grad.mul_((grad_logp[s:s + chunk] / temperature).unsqueeze(-1)).to(compute_dtype)
            grad_hidden[s:s + chunk] = (grad @ w).to(hidden.dtype)
            if grad.dtype == torch.float32:
                grad_weight.addmm_(grad.t(), h)
            else:  # the chunk's product in the head's dtype, added in fp32 without an fp32 copy of it
                grad_weight.add_(grad.t() @ h)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None, None


def chunked_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    chunk_tokens: int,
    temperature: float = 1.0,
    compute_dtype: torch.dtype | None = None,
    tp_group=None,
    tp_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`vocab_parallel_logprobs` gives for ``logits = hidden @ weight.T``, without ever
    holding more than ``chunk_tokens`` rows of logits (forward and backward).

    Args:
        hidden: ``[N, h]`` the last hidden states of the positions wanted (only those: a prompt or
            padding position given here costs a logits row), the same on every TP rank.
        weight: ``[V/tp, h]`` this rank's slice of the (padded) output weight.
        targets: ``[N]`` int64 global token ids.
        chunk_tokens: rows of logits computed at a time.
        compute_dtype: the matmul's dtype (fp32 for an fp32 head); default: the weight's.
    Returns:
        ``(logp [N] fp32, differentiable in hidden and weight; entropy [N] fp32, no gradient)``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if chunk_tokens < 1:
        raise ValueError(f"trainer.logprob_chunk_tokens must be >= 1 here, got {chunk_tokens}.")
    vocab_start = tp_rank * weight.shape[0]
    return _ChunkedHeadLogProb.apply(hidden, weight, targets, float(temperature), vocab_start, vocab_size,
                                     int(chunk_tokens), compute_dtype or weight.dtype, tp_group)
