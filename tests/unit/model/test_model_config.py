"""HF config.json -> ModelArch, and the provider's refusals (pure, no distributed)."""

import pytest

from megatron_apriel.model.arch import ModelArch
from megatron_apriel.model.config import ModelConfig
from megatron_apriel.model.provider import padded_vocab_size, resolve_impl

MISTRAL_TEXT = {"model_type": "mistral", "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 14336,
                "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "rope_theta": 1e9, "rms_norm_eps": 1e-5, "hidden_act": "silu", "sliding_window": None,
                "tie_word_embeddings": False}


def test_apriel_llava_reads_text_config():
    arch = ModelArch.from_hf_config({"model_type": "llava", "text_config": MISTRAL_TEXT, "vision_config": {}})
    assert (arch.family, arch.num_layers, arch.head_dim, arch.num_kv_heads) == ("mistral", 48, 128, 8)
    assert arch.head_dim * arch.num_heads != arch.hidden_size  # explicit head_dim kept
    assert arch.rope_theta == 1e9 and not arch.qkv_bias and not arch.qk_norm and not arch.tie_embeddings


def test_qwen_families():
    base = dict(MISTRAL_TEXT, sliding_window=4096, use_sliding_window=False)
    base.pop("head_dim")
    qwen2 = ModelArch.from_hf_config(dict(base, model_type="qwen2", tie_word_embeddings=True))
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.tie_embeddings and qwen2.head_dim == 5120 // 32
    qwen3 = ModelArch.from_hf_config(dict(base, model_type="qwen3", head_dim=128))
    assert qwen3.qk_norm and not qwen3.qkv_bias


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "unsupported HF model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported: Megatron-Core"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope scaling 'linear'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}}, "low_freq_factor"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 4096}},
     "original_max_position_embeddings"),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, "max_window_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_refuses_what_it_would_get_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_config(dict(MISTRAL_TEXT, **change))


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])  # transformers < 5 and >= 5
def test_llama3_rope_scaling_is_read(key):
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    arch = ModelArch.from_hf_config(dict(MISTRAL_TEXT, model_type="llama", **{key: scaling}))
    assert arch.rope_scaling_factor == 32.0
    assert ModelArch.from_hf_config(MISTRAL_TEXT).rope_scaling_factor is None


def test_sliding_window_is_accepted_only_when_it_covers_the_sequence(caplog):
    arch = ModelArch.from_hf_config(dict(MISTRAL_TEXT, sliding_window=4096))
    assert arch.sliding_window == 4096
    with caplog.at_level("INFO", logger="megatron_apriel"):
        arch.check_sequence_length(4096)
    assert "never masks" in caplog.text
    with pytest.raises(ValueError, match="shorter than trainer.seq_len=4097.*trainer.seq_len<=4096"):
        arch.check_sequence_length(4097)
    qwen = ModelArch.from_hf_config(dict(MISTRAL_TEXT, model_type="qwen2", sliding_window=4096,
                                         use_sliding_window=False))
    assert qwen.sliding_window is None


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelArch.from_hf_dir(tmp_path)


def test_fp8_without_transformer_engine_is_an_error_not_a_fallback():
    with pytest.raises(ValueError, match="model.fp8=hybrid needs Transformer Engine"):
        resolve_impl(ModelConfig(fp8="hybrid", transformer_impl="auto"))
    with pytest.raises(ValueError, match="transformer_impl=transformer_engine needs CUDA"):
        resolve_impl(ModelConfig(transformer_impl="transformer_engine"))
    assert resolve_impl(ModelConfig()) == "local"


def test_padded_vocab():
    assert padded_vocab_size(250, 1) == 256
    assert padded_vocab_size(250, 2) == 256
    assert padded_vocab_size(257, 2) == 512
    assert padded_vocab_size(131072, 4) == 131072


def test_gpu_switch_sets_te_fp8_bf16_and_fused_kernels(monkeypatch):
    """What the GPU path would build, checked on the CPU by pretending TE and CUDA are present."""
    import dataclasses

    import torch

    from megatron_apriel.model import provider
    from megatron_apriel.parallel.dims import ParallelDims
    from megatron_apriel.parallel.groups import ParallelContext

    monkeypatch.setattr(provider, "te_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ctx = ParallelContext(dims=ParallelDims(tp=1, pp=1, dp=1), rank=0, tp_rank=0, pp_rank=0, dp_rank=0,
                          device=torch.device("cuda", 0), pgs=None)
    arch = ModelArch.from_hf_config(MISTRAL_TEXT)
    kw = provider.transformer_config_kwargs(ModelConfig(fp8="hybrid", fp8_recipe="blockwise"), arch, ctx)
    assert kw["transformer_impl"] == "transformer_engine"
    assert (kw["fp8"], kw["fp8_recipe"]) == ("hybrid", "blockwise")
    assert kw["bf16"] and kw["params_dtype"] == torch.bfloat16 and not kw["use_cpu_initialization"]
    assert kw["masked_softmax_fusion"] and kw["apply_rope_fusion"]
    assert (kw["kv_channels"], kw["num_query_groups"]) == (128, 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu_ctx = dataclasses.replace(ctx, device=torch.device("cpu"))
    cpu = provider.transformer_config_kwargs(ModelConfig(), arch, cpu_ctx)
    assert cpu["transformer_impl"] == "local" and cpu["params_dtype"] == torch.float32 and cpu["fp8"] is None
    assert not cpu["masked_softmax_fusion"] and cpu["use_cpu_initialization"]
    assert (cpu["hidden_dropout"], cpu["attention_dropout"]) == (0.0, 0.0)
    drop = provider.transformer_config_kwargs(ModelConfig(dropout=0.1), arch, cpu_ctx)
    assert (drop["hidden_dropout"], drop["attention_dropout"]) == (0.1, 0.1)
    with pytest.raises(ValueError, match="model.dropout"):
        ModelConfig(dropout=1.0)


def test_moe_families_from_the_published_configs():
    import json
    from pathlib import Path

    import megatron_apriel

    conf = Path(megatron_apriel.__file__).parent / "conf" / "models"
    a3b = ModelArch.from_hf_dir(conf / "qwen3_30b_a3b")
    assert (a3b.family, a3b.num_experts, a3b.moe_top_k, a3b.moe_ffn_hidden_size, a3b.ffn_hidden_size) == \
        ("qwen3_moe", 128, 8, 768, 6144)
    assert a3b.norm_topk_prob and a3b.qk_norm and a3b.moe_layers == list(range(48)) and not a3b.dense_layers
    cfg = json.loads((conf / "qwen3_30b_a3b" / "config.json").read_text())
    sparse_step = ModelArch.from_hf_config(dict(cfg, decoder_sparse_step=2, mlp_only_layers=[5]))
    assert sparse_step.dense_layers == sorted(set(range(0, 48, 2)) | {5})  # sparse: (i + 1) % 2 == 0, i != 5
    unnormalised = ModelArch.from_hf_config(dict(cfg, norm_topk_prob=False))  # Qwen3MoeConfig's default
    assert not unnormalised.norm_topk_prob
    mixtral = ModelArch.from_hf_config(dict(MISTRAL_TEXT, model_type="mixtral", num_local_experts=8,
                                            num_experts_per_tok=2, router_jitter_noise=0.0))
    assert (mixtral.num_experts, mixtral.moe_ffn_hidden_size, mixtral.norm_topk_prob) == (8, 14336, True)


MIXTRAL = dict(MISTRAL_TEXT, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize("change, message", [
    ({"router_jitter_noise": 0.01}, "router_jitter_noise=0.01 is not supported"),
    ({"scoring_func": "sigmoid"}, "router scoring 'sigmoid'"),
    ({"n_shared_experts": 1}, "shared experts"),
    ({"num_experts_per_tok": 1}, "moe_top_k=1 with norm_topk_prob"),
    ({"num_experts_per_tok": 9}, "moe_top_k must be in"),
])
def test_moe_refusals(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_config(dict(MIXTRAL, **change))


def test_dense_layers_must_leave_a_sparse_one():
    with pytest.raises(ValueError, match="no MoE layer"):
        ModelArch(family="qwen3_moe", num_layers=2, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=8,
                  dense_layers=[0, 1])
    with pytest.raises(ValueError, match="a Mixtral model has no dense layers"):
        ModelArch(family="mixtral", num_layers=2, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=8,
                  dense_layers=[0])
