"""The last stage's output layer, switchable to return its input: the hidden states, for log-probs
computed chunk by chunk from them and the output weight (``trainer.logprobs.chunked_head_logprobs``)
instead of from the full ``[tokens, V/tp]`` logits.

Switched per call (:func:`emitting_hidden`), so one built model serves both paths. In hidden mode the
layer does to its input what Megatron's column-parallel output layer does before its matmul, so
gradients flow back exactly as they would through the logits:

- with sequence parallelism, it all-gathers the sequence over TP (backward: reduce-scatter);
- otherwise, at TP > 1, it marks the input as copied to every TP rank (backward: all-reduce, each
  rank having contributed the gradient of its vocabulary slice).

It returns ``[s, b, h]`` (the whole sequence on every TP rank), which ``GPTModel`` transposes to
``[b, s, h]`` as it does the logits. :func:`head_weight` is the weight the layer would have used
(the shared embedding when input and output embeddings are tied).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def install_hidden_switch(layer) -> None:
    """Give an output layer (``ColumnParallelLinear``) its hidden mode, off until switched on."""
    logits_forward = layer.forward
    layer.emit_hidden = False

    def forward(input_, weight=None, **kwargs):
        if not layer.emit_hidden:
            return logits_forward(input_, weight=weight, **kwargs)
        return _replicated_over_tp(layer, input_), None

    layer.forward = forward


def _replicated_over_tp(layer, input_: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    group = layer.tp_group
    if group is None or group.size() == 1:
        return input_
    if layer.sequence_parallel:
        out = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group)
    else:
        out = copy_to_tensor_model_parallel_region(input_, group=group)
    return _ContiguousGrad.apply(out)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. ``GPTModel`` transposes our output to
    ``[b, s, h]``, so with b > 1 the gradient reaches the TP region above as a non-contiguous view,
    and Megatron's all-reduce of it (``mappings._reduce``: ``all_reduce(grad.contiguous())``, then
    returns ``grad``) reduces a copy and hands back the unreduced tensor: each TP rank would keep
    only its own vocabulary slice's share of the hidden-state gradient (a padded TP2 test caught it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _gpt(model):
    """The ``GPTModel`` inside Megatron's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


@contextmanager
def emitting_hidden(model, on: bool = True):
    """Within the block, the model's last stage returns hidden states ``[b, s, h]`` instead of logits
    (a no-op on other stages, which have no output layer)."""
    gpt = _gpt(model)
    layer = getattr(gpt, "output_layer", None) if gpt.post_process else None
    if layer is None or not on:
        yield
        return
    if not hasattr(layer, "emit_hidden"):
        raise RuntimeError("this model's output layer has no hidden mode: build it with model.build_model.")
    layer.emit_hidden = True
    try:
        yield
    finally:
        layer.emit_hidden = False


def head_weight(model) -> torch.Tensor:
    """The output weight ``[V/tp, h]`` of the model's last stage, as ``GPTModel`` passes it."""
    gpt = _gpt(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def head_in_fp32(model) -> bool:
    """Whether the output layer multiplies in fp32 (``model.fp32_lm_head``)."""
    return bool(getattr(_gpt(model).output_layer, "fp32_compute", False))
