"""The parameter tensors of one pipeline stage of our ``GPTModel``, in ``named_parameters`` order.

Shapes follow Megatron's TP split (heads, KV groups and the MLP are split over ``tp``; norms are
replicated; the vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp``).
The order matters for the distributed optimizer's shards (see :mod:`.buffers`); it is the order
of the local layer spec (checked against a real model in tests) and, for the Transformer Engine
spec, the order its fused layer-norm linears register their tensors in.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_apriel.model.arch import ModelArch, padded_vocab_size

SPECS = ("local", "transformer_engine")


@dataclass(frozen=True)
class StageShape:
    """Where one rank sits: its TP size and its pipeline stage."""

    tp: int
    pp: int
    stage: int
    spec: str = "local"
    """local (CPU, or GPU without TE) or transformer_engine (norms fused into the linears)."""
    vocab_divisible_by: int = 128

    def __post_init__(self) -> None:
        if self.spec not in SPECS:
            raise ValueError(f"spec must be one of {SPECS}, got {self.spec!r}.")
        if not 0 <= self.stage < self.pp:
            raise ValueError(f"stage {self.stage} is outside 0..{self.pp - 1}.")

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1


def _layer(arch: ModelArch, tp: int, spec: str, prefix: str) -> list[tuple[str, int]]:
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size // tp
    q, qkv = arch.num_heads * d // tp, (arch.num_heads + 2 * arch.num_kv_heads) * d // tp
    bias = [(prefix + "self_attention.linear_qkv.bias", qkv)] if arch.qkv_bias else []
    qk_norm = ([(prefix + "self_attention.q_layernorm.weight", d), (prefix + "self_attention.k_layernorm.weight", d)]
               if arch.qk_norm else [])
    proj = [(prefix + "self_attention.linear_proj.weight", h * q)]
    fc2 = [(prefix + "mlp.linear_fc2.weight", h * f)]
    if spec == "local":
        return ([(prefix + "input_layernorm.weight", h)] + proj + [(prefix + "self_attention.linear_qkv.weight", qkv * h)]
                + bias + qk_norm + [(prefix + "pre_mlp_layernorm.weight", h), (prefix + "mlp.linear_fc1.weight", 2 * f * h)]
                + fc2)
    return (proj + [(prefix + "self_attention.linear_qkv.layer_norm_weight", h),
                    (prefix + "self_attention.linear_qkv.weight", qkv * h)] + bias + qk_norm
            + [(prefix + "mlp.linear_fc1.layer_norm_weight", h), (prefix + "mlp.linear_fc1.weight", 2 * f * h)] + fc2)


def stage_params(arch: ModelArch, where: StageShape) -> list[tuple[str, int]]:
    """``(name, numel)`` of every parameter on one rank of this stage, in registration order."""
    vocab_rows = padded_vocab_size(arch.vocab_size, where.tp, where.vocab_divisible_by) // where.tp
    per_stage = arch.num_layers // where.pp
    out = []
    if where.first:
        out.append(("embedding.word_embeddings.weight", vocab_rows * arch.hidden_size))
    for i in range(per_stage):  # local indices: Megatron numbers each stage's layers from 0
        out += _layer(arch, where.tp, where.spec, f"decoder.layers.{i}.")
    if where.last:
        out.append(("decoder.final_layernorm.weight", arch.hidden_size))
        # tied embeddings: the head reuses the embedding on a single stage, holds a copy otherwise
        if not arch.tie_embeddings or not where.first:
            out.append(("output_layer.weight", vocab_rows * arch.hidden_size))
    return out


def element_bytes(name: str, where: StageShape, param_bytes: int) -> int:
    """Bytes per element of a parameter: the local spec's torch norms keep fp32 weights in a
    16-bit model (Megatron's ``WrappedTorchNorm`` is built without a dtype); all else is ``param_bytes``."""
    return 4 if where.spec == "local" and name.endswith("layernorm.weight") else param_bytes


def is_shared_embedding(arch: ModelArch, where: StageShape, name: str) -> bool:
    """Megatron gives the tied embedding (and its copy on the last stage) its own bucket when pp > 1."""
    return (arch.tie_embeddings and where.pp > 1
            and name in ("embedding.word_embeddings.weight", "output_layer.weight"))


def parameter_count(arch: ModelArch) -> int:
    """Parameters of the HF model (true vocabulary, tied head counted once)."""
    h, d = arch.hidden_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    layer = (2 * h + qkv * h + h * arch.num_heads * d + 3 * h * arch.ffn_hidden_size
             + (qkv if arch.qkv_bias else 0) + (2 * d if arch.qk_norm else 0))
    embeddings = arch.vocab_size * h * (1 if arch.tie_embeddings else 2)
    return arch.num_layers * layer + embeddings + h
