"""The parameter tensors of one pipeline stage of our ``GPTModel``, in ``named_parameters`` order.

Shapes follow Megatron's TP split (heads, KV groups and the MLP are split over ``tp``; norms are
replicated; the vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp``). In a
mixture of experts a sparse layer holds the router (replicated) and ``num_experts / ep`` whole
experts (expert TP is 1).
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
    ep: int = 1
    """Expert-parallel size: a sparse layer holds num_experts / ep experts."""

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


def _attention(arch: ModelArch, tp: int, spec: str, prefix: str) -> list[tuple[str, int]]:
    h, d = arch.hidden_size, arch.head_dim
    q, qkv = arch.num_heads * d // tp, (arch.num_heads + 2 * arch.num_kv_heads) * d // tp
    bias = [(prefix + "self_attention.linear_qkv.bias", qkv)] if arch.qkv_bias else []
    qk_norm = ([(prefix + "self_attention.q_layernorm.weight", d), (prefix + "self_attention.k_layernorm.weight", d)]
               if arch.qk_norm else [])
    proj = [(prefix + "self_attention.linear_proj.weight", h * q)]
    if spec == "local":
        return ([(prefix + "input_layernorm.weight", h)] + proj
                + [(prefix + "self_attention.linear_qkv.weight", qkv * h)] + bias + qk_norm)
    return proj + [(prefix + "self_attention.linear_qkv.layer_norm_weight", h),
                   (prefix + "self_attention.linear_qkv.weight", qkv * h)] + bias + qk_norm


def _dense_mlp(arch: ModelArch, tp: int, spec: str, prefix: str) -> list[tuple[str, int]]:
    h, f = arch.hidden_size, arch.ffn_hidden_size // tp
    norm = "pre_mlp_layernorm.weight" if spec == "local" else "mlp.linear_fc1.layer_norm_weight"
    return [(prefix + norm, h), (prefix + "mlp.linear_fc1.weight", 2 * f * h),
            (prefix + "mlp.linear_fc2.weight", h * f)]


def _experts(arch: ModelArch, ep: int, spec: str, prefix: str) -> list[tuple[str, int]]:
    """A sparse layer's MLP: its own norm (TE fuses none into the experts), the router, this rank's
    experts (SequentialMLP: each expert's fc1 then fc2; TEGroupedMLP: every fc1, then every fc2)."""
    h, fe, n = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts // ep
    out = [(prefix + "pre_mlp_layernorm.weight", h), (prefix + "mlp.router.weight", arch.num_experts * h)]
    if spec == "local":
        return out + [(prefix + f"mlp.experts.local_experts.{i}.linear_fc{k}.weight", size)
                      for i in range(n) for k, size in ((1, 2 * fe * h), (2, h * fe))]
    return out + [(prefix + f"mlp.experts.linear_fc1.weight{i}", 2 * fe * h) for i in range(n)] + \
        [(prefix + f"mlp.experts.linear_fc2.weight{i}", h * fe) for i in range(n)]


def _layer(arch: ModelArch, where: StageShape, prefix: str, layer: int) -> list[tuple[str, int]]:
    mlp = (_experts(arch, where.ep, where.spec, prefix) if arch.is_moe_layer(layer)
           else _dense_mlp(arch, where.tp, where.spec, prefix))
    return _attention(arch, where.tp, where.spec, prefix) + mlp


def is_expert(name: str) -> bool:
    """An expert's weight (in the expert-parallel buffers, sharded over expert-DP)."""
    return ".mlp.experts." in name


def stage_params(arch: ModelArch, where: StageShape) -> list[tuple[str, int]]:
    """``(name, numel)`` of every parameter on one rank of this stage, in registration order."""
    vocab_rows = padded_vocab_size(arch.vocab_size, where.tp, where.vocab_divisible_by) // where.tp
    per_stage = arch.num_layers // where.pp
    out = []
    if where.first:
        out.append(("embedding.word_embeddings.weight", vocab_rows * arch.hidden_size))
    for i in range(per_stage):  # local indices: Megatron numbers each stage's layers from 0
        out += _layer(arch, where, f"decoder.layers.{i}.", where.stage * per_stage + i)
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


def parameter_count(arch: ModelArch, active: bool = False) -> int:
    """Parameters of the HF model (true vocabulary, tied head counted once); ``active``: those one
    token goes through (a sparse layer's router and top-k experts only)."""
    h, d = arch.hidden_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    attention = (2 * h + qkv * h + h * arch.num_heads * d + (qkv if arch.qkv_bias else 0)
                 + (2 * d if arch.qk_norm else 0))
    experts = arch.moe_top_k if active else arch.num_experts
    sparse = arch.num_experts * h + experts * 3 * h * arch.moe_ffn_hidden_size
    mlp = sum(sparse if arch.is_moe_layer(i) else 3 * h * arch.ffn_hidden_size for i in range(arch.num_layers))
    embeddings = arch.vocab_size * h * (1 if arch.tie_embeddings else 2)
    return arch.num_layers * attention + mlp + embeddings + h
