"""HF config.json -> ModelArch, and the provider's refusals (pure, no distributed)."""

import pytest

from megatron_apriel.model.arch import ModelArch
from megatron_apriel.model.provider import ModelConfig, padded_vocab_size, resolve_impl

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
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_refuses_what_it_would_get_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArch.from_hf_config(dict(MISTRAL_TEXT, **change))


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
