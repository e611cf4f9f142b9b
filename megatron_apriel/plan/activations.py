"""An ESTIMATE of the activation bytes one micro-batch keeps for backward on one rank.

Counted per decoder layer from the tensors its autograd graph saves (``s`` tokens per
micro-batch, ``B`` bytes per element, TP size ``t``; with sequence parallelism the per-token
tensors outside attention and the MLP are split over ``t`` as well). ``kernels`` says whose:

- ``local`` (Megatron's local spec: the CPU path). Each torch RMSNorm keeps its input, the
  normalised input and an fp32 ``1/rms``; each linear its input (qkv and fc1 the norm output,
  proj the attention output ``nq*d/t``, fc2 the SwiGLU output ``f/t``); SwiGLU the fc1 output
  (``2f/t``), ``silu(gate)`` and a product (``f/t`` each); RoPE its cos and sin for q and k. The
  unfused attention keeps contiguous q and k at ``nq`` heads, v (repeated to ``nq`` heads for GQA,
  else a view that keeps the whole qkv output), a bool causal mask (``s`` per token) and the
  softmax (``nq/t * s`` per token, fp32 when the model is 16-bit);
- ``te`` (Transformer Engine on GPU: fused norm+linear, fused RoPE, flash attention). The norm
  keeps its input and ``1/rms`` (its output is the linear's input); attention keeps rotated q and
  k, the qkv output (v is a view of it) and an fp32 log-sum-exp per head; no ``s^2`` term;
- the head, chunked (``trainer.logprob_chunk_tokens`` > 0): the final norm's tensors, the hidden
  states of the loss positions (all tokens, at worst; in place of the output layer's input) with
  their indices, targets and fp32 log-sum-exp;
  at its peak one chunk's logits, their fp32 copy and one more fp32 ``[chunk, V/tp]`` tensor, with
  the output weight's fp32 gradient accumulator (and, for 16-bit weights, one chunk's contribution);
- the head, full logits (``logprob_chunk_tokens=0``): the final norm's tensors, the output layer's
  input, and for the log-prob the fp32 softmax over the local vocabulary; at its peak the logits and their
  fp32 copy coexist with it.

A mixture of experts' sparse layer replaces the dense MLP's tensors with its experts': each token is
sent to ``k`` experts (the dispatcher keeps the permuted copies, ``k*h`` per token, and the
experts each keep fc1's input, SwiGLU's three tensors and fc2's input at the expert width ``fe``:
``k*(2h + 5fe)`` per token), assuming the tokens balanced over the experts; the dispatcher's
communication buffers and an imbalanced routing are not counted (marked as estimates).

Recomputation: ``selective`` re-runs core attention (only rotated q, k and the qkv output are
kept); ``full`` keeps each layer's input and rebuilds one layer at a time in backward. This is
an estimate: allocator rounding, backward temporaries and communication buffers are not
counted. Tests compare it with the saved tensors of a real model on CPU (local, within 20%).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_apriel.model.arch import ModelArch, padded_vocab_size

FP32 = 4
KERNELS = ("local", "te")
RECOMPUTE = (None, "selective", "full")


@dataclass(frozen=True)
class ActivationShape:
    tokens: int
    """Tokens per micro-batch (``trainer.seq_len``: one packed row)."""
    tp: int = 1
    dtype_bytes: int = 2
    sequence_parallel: bool = False
    kernels: str = "te"
    """te (Transformer Engine spec, flash attention) or local (Megatron's local spec, the CPU path)."""
    logprob_chunk_tokens: int = 0
    """``trainer.logprob_chunk_tokens``: 0 for the head's full logits."""

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}.")


def _attention(arch: ModelArch, a: ActivationShape, recompute: str | None) -> float:
    """Per token: what attention keeps (RoPE included), in bytes."""
    nq, nkv, d, t, s, B = arch.num_heads, arch.num_kv_heads, arch.head_dim, a.tp, a.tokens, a.dtype_bytes
    qkv = (nq + 2 * nkv) * d // t
    inputs = B * ((nq + nkv) * d // t + qkv)  # rotated q and k; v is a view keeping the qkv output
    if a.kernels == "te":
        return inputs + (0 if recompute == "selective" else FP32 * nq // t)
    rope = 4 * B * d  # cos and sin, for q and for k
    if recompute == "selective":
        return rope + inputs
    v = nq * d // t if nq != nkv else qkv
    softmax = (nq // t) * s * (B + (FP32 if B != FP32 else 0))
    return rope + B * (2 * nq * d // t + v) + softmax + s


def layer_bytes(arch: ModelArch, a: ActivationShape, recompute: str | None = None, layer: int = 0) -> float:
    """Bytes decoder layer ``layer`` keeps for one micro-batch."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}.")
    h, f, t, B = arch.hidden_size, arch.ffn_hidden_size // a.tp, a.tp, a.dtype_bytes
    split = t if a.sequence_parallel else 1
    if recompute == "full":
        return a.tokens * B * h / split
    norm = (2 * B * h if a.kernels == "local" else B * h) + FP32  # input (+ normed input), 1/rms
    attention = _attention(arch, a, recompute)
    if arch.is_moe_layer(layer):  # each token's k copies through the experts (tokens split over TP)
        experts = arch.moe_top_k * B * (2 * h + 5 * arch.moe_ffn_hidden_size) / split
        linears = B * (h / split + arch.num_heads * arch.head_dim // t)  # qkv, proj inputs
        return a.tokens * (2 * norm / split + linears + experts + attention)
    linears = B * (2 * h / split + arch.num_heads * arch.head_dim // t + f)  # qkv, fc1, proj, fc2 inputs
    swiglu = B * 4 * f
    return a.tokens * (2 * norm / split + linears + swiglu + attention)


def head_bytes(arch: ModelArch, a: ActivationShape, vocab_divisible_by: int = 128) -> dict[str, float]:
    """The last stage's head: what it keeps for backward, and its transient peak."""
    v_local = padded_vocab_size(arch.vocab_size, a.tp, vocab_divisible_by) // a.tp
    split = a.tp if a.sequence_parallel else 1
    B, h = a.dtype_bytes, arch.hidden_size
    norm = 2 * B * h / split + FP32 / split  # the final norm: its input and normalised input, 1/rms
    if a.logprob_chunk_tokens:
        # the loss positions' hidden states (whole on every TP rank) with their indices, targets,
        # log-sum-exp and mask, in place of the output layer's input and the softmax
        kept = a.tokens * (norm + B * h + 8 + 8 + FP32 + 1)
        rows, cast = min(a.logprob_chunk_tokens, a.tokens), (FP32 if B != FP32 else 0)
        peak = rows * v_local * (B + cast + FP32) + v_local * h * (FP32 + (B if cast else 0))
        return {"kept": kept, "peak_extra": peak}
    kept = a.tokens * (norm + B * h / split + FP32 * v_local + 9)  # the output layer's input, the softmax
    logits = a.tokens * v_local * (a.dtype_bytes + (FP32 if a.dtype_bytes != FP32 else 0))
    return {"kept": kept, "peak_extra": logits}


def stage_activation_bytes(arch: ModelArch, a: ActivationShape, *, pp: int, stage: int,
                           recompute: str | None) -> float:
    """Activations held on ``stage`` at the 1F1B peak: ``pp - stage`` micro-batches in flight."""
    per_stage = arch.num_layers // pp
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    per_mb = sum(layer_bytes(arch, a, recompute, i) for i in layers)
    held = (pp - stage) * per_mb
    if recompute == "full":  # backward rebuilds one layer at a time
        held += max(layer_bytes(arch, a, None, i) for i in layers)
    return held
