"""The planner's activation estimate against the tensors a real model saves for backward (CPU).

Measured: the distinct storages (parameters excluded) that autograd keeps while a packed
micro-batch goes through our Megatron GPTModel (local spec, one rank) and the trainer's
log-prob, read with ``torch.autograd.graph.saved_tensors_hooks``. The estimate must be within
20% for several shapes, precisions and recomputation settings.
"""

from dataclasses import replace

import pytest
import torch

from megatron_apriel.model import ModelArch, ModelConfig, build_model
from megatron_apriel.parallel.rendezvous import single_process_world
from megatron_apriel.plan.activations import ActivationShape, head_bytes, layer_bytes
from megatron_apriel.records.samples import TrainSample
from megatron_apriel.trainer.batch import packed_microbatches
from megatron_apriel.trainer.step import forward_logits, token_logprobs

ARCHS = {
    "gqa": ModelArch(family="llama", vocab_size=500, hidden_size=64, ffn_hidden_size=176, num_layers=3, num_heads=8,
                     num_kv_heads=2, head_dim=16),
    "mha_bias": ModelArch(family="qwen2", vocab_size=300, hidden_size=96, ffn_hidden_size=256, num_layers=2,
                          num_heads=4, num_kv_heads=4, head_dim=24, qkv_bias=True),
    # a mixture of experts with a dense middle layer: the estimate assumes balanced routing
    "moe": ModelArch(family="qwen3_moe", vocab_size=500, hidden_size=64, ffn_hidden_size=176, num_layers=3,
                     num_heads=8, num_kv_heads=2, head_dim=16, qk_norm=True, num_experts=8, moe_top_k=2,
                     moe_ffn_hidden_size=48, dense_layers=[1]),
}


@pytest.fixture(scope="module")
def ctx():
    with single_process_world() as ctx:
        yield ctx


def _saved_bytes(model, ctx, arch: ModelArch, tokens: int, chunk: int = 0) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    lengths = [tokens // 2, tokens // 4, tokens - tokens // 2 - tokens // 4]
    samples = [TrainSample(torch.randint(0, arch.vocab_size, (n,), generator=g).tolist(), 2, [-1.0] * (n - 2), 1.0)
               for n in lengths]
    (mb,) = packed_microbatches(samples, [0, 1, 2], tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = forward_logits(model, mb, hidden=chunk > 0)
        logp, _ = token_logprobs(output, mb, ctx, arch.vocab_size, 1.0, model=model, chunk_tokens=chunk)
    logp.sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize("name", sorted(ARCHS))
@pytest.mark.parametrize("tokens", [64, 256])
@pytest.mark.parametrize("precision, recompute", [("fp32", None), ("fp32", "full"),
                                                  ("fp32", "selective")])
@pytest.mark.parametrize("chunk", [0, 16])
def test_activation_estimate_within_20_percent(ctx, name, tokens, precision, recompute, chunk):
    arch = ARCHS[name]
    model = build_model(ModelConfig(arch=arch, precision=precision, recompute=recompute), ctx)
    measured = _saved_bytes(model, ctx, arch, tokens, chunk)
    shape = ActivationShape(tokens=tokens, dtype_bytes=4 if precision == "fp32" else 2, kernels="local",
                            logprob_chunk_tokens=chunk)
    estimate = (sum(layer_bytes(arch, shape, recompute, i) for i in range(arch.num_layers))
                + head_bytes(arch, shape)["kept"])
    assert abs(estimate - measured) <= 0.2 * measured, f"estimate {estimate:.0f} B, measured {measured} B"


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_the_chunked_head_saves_what_the_estimate_says_it_saves(ctx, name):
    """The head is a few percent of the total above, so it is checked on its own: the bytes the full
    logits keep beyond the chunked path's, measured on the same model, against the estimates' difference."""
    arch, tokens = ARCHS[name], 256
    model = build_model(ModelConfig(arch=arch, precision="fp32"), ctx)
    measured = _saved_bytes(model, ctx, arch, tokens, 0) - _saved_bytes(model, ctx, arch, tokens, 16)
    shape = ActivationShape(tokens=tokens, dtype_bytes=4, kernels="local")
    estimate = head_bytes(arch, shape)["kept"] - head_bytes(arch, replace(shape, logprob_chunk_tokens=16))["kept"]
    assert measured > 0 and abs(estimate - measured) <= 0.2 * measured, \
        f"estimate {estimate:.0f} B, measured {measured} B"
