"""Build Megatron-Core's ``GPTModel`` for one pipeline stage from a ``ModelConfig``.

GPU (CUDA + Transformer Engine): TE layer spec, bf16, optional FP8. CPU: the local spec in fp32.
Asking for something the machine cannot do (FP8 without TE/CUDA, TE without TE) is an error,
never a silent fallback.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megatron_apriel.model.arch import ModelArch, padded_vocab_size  # noqa: F401 (re-exported)
from megatron_apriel.model.config import ModelConfig
from megatron_apriel.model.head import install_hidden_switch
from megatron_apriel.parallel.groups import ParallelContext


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_impl(cfg: ModelConfig) -> str:
    """The layer implementation this machine will run, or a ValueError saying why not."""
    has_te = te_available() and torch.cuda.is_available()
    impl = cfg.transformer_impl
    if impl == "auto":
        impl = "transformer_engine" if has_te else "local"
    if impl == "transformer_engine" and not has_te:
        raise ValueError(
            "model.transformer_impl=transformer_engine needs CUDA and transformer-engine "
            "(pip install -e '.[gpu]'); on a CPU machine use model.transformer_impl=local."
        )
    if cfg.fp8 is not None and impl != "transformer_engine":
        raise ValueError(
            f"model.fp8={cfg.fp8} needs Transformer Engine on a CUDA GPU (transformer_impl resolved to "
            f"{impl!r}); set model.fp8=null on this machine."
        )
    return impl


def resolve_dtype(cfg: ModelConfig) -> torch.dtype:
    precision = cfg.precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() else "fp32"
    return torch.bfloat16 if precision == "bf16" else torch.float32


def transformer_config(cfg: ModelConfig, arch: ModelArch, ctx: ParallelContext):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**transformer_config_kwargs(cfg, arch, ctx))


def transformer_config_kwargs(cfg: ModelConfig, arch: ModelArch, ctx: ParallelContext) -> dict:
    """Megatron ``TransformerConfig`` arguments for this machine (pure: testable without TE/CUDA)."""
    impl = resolve_impl(cfg)
    dtype = resolve_dtype(cfg)
    ctx.dims.check_model(num_layers=arch.num_layers, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                         num_experts=arch.num_experts)
    on_gpu = ctx.device.type == "cuda"
    return dict(
        **moe_kwargs(cfg, arch, ctx, impl),
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=cfg.dropout,
        attention_dropout=cfg.dropout,
        init_method_std=cfg.init_std,
        tensor_model_parallel_size=ctx.dims.tp,
        pipeline_model_parallel_size=ctx.dims.pp,
        context_parallel_size=ctx.dims.cp,
        cp_comm_type=ctx.cp_comm_type if ctx.dims.cp > 1 else None,
        sequence_parallel=ctx.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # The loss returns (sum, count); Megatron divides the gradients by the global count.
        calculate_per_token_loss=True,
        transformer_impl=impl,
        fp8=cfg.fp8,
        fp8_recipe=cfg.fp8_recipe if cfg.fp8 else "delayed",
        recompute_granularity=cfg.recompute,
        recompute_method="uniform" if cfg.recompute == "full" else None,
        recompute_num_layers=1 if cfg.recompute == "full" else None,
        # Fused kernels: the softmax / RoPE ones come from Transformer Engine (or Apex), so the local
        # spec on a GPU without TE runs the unfused torch code; bias-dropout-add fusion is torch.jit.
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=impl == "transformer_engine",
        apply_rope_fusion=impl == "transformer_engine",
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def moe_kwargs(cfg: ModelConfig, arch: ModelArch, ctx: ParallelContext, impl: str) -> dict:
    """The ``TransformerConfig`` arguments of a mixture-of-experts model ({} for a dense one).

    Routing as the HF families define it: a softmax over the experts' logits, the top k, their
    weights renormalised (``norm_topk_prob``; Megatron's default, the softmax of the k chosen
    logits, is the same) or not (``moe_router_pre_softmax``: top k of the full softmax). The router
    runs in fp32; tokens are never dropped (no capacity factor), as in vLLM."""
    if not arch.is_moe:
        return {}
    if ctx.dims.tp > 1 and not ctx.sequence_parallel:
        raise ValueError(f"a mixture-of-experts model with parallel.tp={ctx.dims.tp} needs parallel.sequence_parallel="
                         "true (Megatron refuses to train MoE layers under tensor parallelism without it); set it, or "
                         "use parallel.tp=1 and split the experts with parallel.ep.")
    moe = cfg.moe
    dispatcher = moe.token_dispatcher
    if dispatcher == "auto":
        dispatcher = "alltoall" if ctx.device.type == "cuda" else "allgather"
    if dispatcher == "alltoall" and ctx.device.type != "cuda":
        raise ValueError("model.moe.token_dispatcher=alltoall needs CUDA (Megatron's alltoall dispatcher uses CUDA "
                         "streams); use allgather (or auto) on a CPU machine.")
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_top_k,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        # A list makes Megatron checkpoint every layer under its own keys (its "non-homogeneous"
        # layout); a model without dense layers keeps the stacked keys of dense models.
        moe_layer_freq=[int(arch.is_moe_layer(i)) for i in range(arch.num_layers)] if arch.dense_layers else 1,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=impl == "transformer_engine" and moe.grouped_gemm,
        moe_permute_fusion=False,
        expert_model_parallel_size=ctx.dims.ep,
        expert_tensor_parallel_size=1,
    )


def layer_spec(config, arch: ModelArch, ctx: ParallelContext):
    """This stage's layer specs: Transformer Engine's, or Megatron's local ones localized (packed
    attention, norms that run under sequence parallelism: ``model/attention.py``). A MoE model gets
    dense and sparse layers as ``moe_layer_freq`` says."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    te = config.transformer_impl == "transformer_engine"
    if arch.is_moe:
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm",
                                                 pp_rank=ctx.pp_rank)
    elif te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:
        layer = specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
        block = TransformerBlockSubmodules(layer_specs=[layer] * (arch.num_layers // ctx.dims.pp), layer_norm=None)
    if te:
        return block
    from megatron_apriel.model.attention import localize
    from megatron_apriel.model.norm import LocalRMSNorm

    for spec in {id(s): s for s in block.layer_specs}.values():
        localize(spec)
    return TransformerBlockSubmodules(layer_specs=block.layer_specs, layer_norm=LocalRMSNorm)


def build_model(cfg: ModelConfig, ctx: ParallelContext):
    """This rank's ``GPTModel`` stage (unwrapped), on ``ctx.device``, in the configured dtype."""
    from megatron.core.models.gpt import GPTModel

    arch = cfg.resolve_arch()
    config = transformer_config(cfg, arch, ctx)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, arch, ctx),
        vocab_size=padded_vocab_size(arch.vocab_size, ctx.dims.tp, cfg.make_vocab_size_divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ctx.is_first_stage,
        post_process=ctx.is_last_stage,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        # Llama-3 scaling: Megatron applies LLAMA3_FIXED's constants, ModelArch refused any others
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        pg_collection=ctx.pgs,
    )
    if model.post_process:
        if cfg.fp32_lm_head:
            _compute_in_fp32(model.output_layer)
        install_hidden_switch(model.output_layer)
    return model.to(ctx.device)


def _compute_in_fp32(linear) -> None:
    """Make a (column-parallel) linear layer multiply in fp32; its weight stays in its dtype and
    receives gradients in that dtype through the cast."""
    forward = linear.forward

    def fp32_forward(input_, weight=None, **kwargs):
        weight = linear.weight if weight is None else weight
        return forward(input_.float(), weight=weight.float(), **kwargs)

    linear.forward = fp32_forward
    linear.fp32_compute = True
