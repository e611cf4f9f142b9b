"""Model provider on one CPU rank: fp32 LM head in a bf16 model."""

import pytest
import torch

from megatron_apriel.model import ModelArch, ModelConfig, build_model
from megatron_apriel.parallel.rendezvous import single_process_world


@pytest.fixture(scope="module")
def ctx():
    with single_process_world() as ctx:
        yield ctx


def test_fp32_lm_head_multiplies_in_fp32_and_trains_the_bf16_weight(ctx):
    model = build_model(ModelConfig(arch=ModelArch(), precision="bf16", fp32_lm_head=True), ctx)
    seen = {}
    model.output_layer.register_forward_pre_hook(lambda mod, args: seen.setdefault("hidden", args[0].detach()))
    ids = torch.randint(0, 512, (2, 8))
    logits = model(ids, torch.arange(8).expand(2, 8), None)
    assert logits.dtype == torch.float32 and model.output_layer.weight.dtype == torch.bfloat16
    expected = torch.nn.functional.linear(seen["hidden"].float(), model.output_layer.weight.float())
    torch.testing.assert_close(logits, expected.transpose(0, 1))
    logits.sum().backward()
    grad = model.output_layer.weight.grad
    assert grad is not None and grad.dtype == torch.bfloat16 and grad.abs().sum() > 0


def test_bf16_logits_without_the_option(ctx):
    model = build_model(ModelConfig(arch=ModelArch(), precision="bf16"), ctx)
    assert model(torch.randint(0, 512, (1, 4)), torch.arange(4)[None], None).dtype == torch.bfloat16


def test_moe_under_tensor_parallelism_needs_sequence_parallelism(ctx):
    import dataclasses

    from megatron_apriel.parallel.dims import ParallelDims

    moe = ModelArch(family="mixtral", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32)
    tp2 = dataclasses.replace(ctx, dims=ParallelDims(tp=2, pp=1, dp=1))
    with pytest.raises(ValueError, match="needs parallel.sequence_parallel=true"):
        build_model(ModelConfig(arch=moe), tp2)


def test_local_norms_are_marked_for_sequence_parallel_gradients(ctx):
    """Under sequence parallelism Megatron sums the gradients of weights marked so over the TP ranks."""
    from megatron_apriel.model.norm import LocalRMSNorm

    model = build_model(ModelConfig(arch=ModelArch(family="qwen3", qk_norm=True)), ctx)
    norms = [m for m in model.modules() if isinstance(m, LocalRMSNorm)]
    assert len(norms) == 2 * 4 + 1  # per layer: input, pre-MLP, q and k norms; then the final norm
    assert all(n.weight.sequence_parallel is False for n in norms)  # this model runs without it
