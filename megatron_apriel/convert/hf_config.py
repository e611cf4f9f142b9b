"""The non-weight files of an HF model directory: config.json from a ModelArch, and copying the
reference's config, tokenizer and generation files."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megatron_apriel.model.arch import LLAMA3_FIXED, ModelArch

HF_CLASSES = {"mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def hf_config_from_arch(arch: ModelArch, dtype: torch.dtype) -> dict:
    """A config.json that transformers loads as the same text model (RoPE scaling and window included)."""
    cfg = {
        "architectures": [HF_CLASSES[arch.family]],
        "model_type": arch.family,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.norm_eps,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch.rope_scaling_factor is not None:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": arch.rope_scaling_factor, **LLAMA3_FIXED}
    if arch.family in ("mistral", "mixtral"):
        cfg["sliding_window"] = arch.sliding_window
    if arch.family in ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral"):
        cfg["attention_bias"] = arch.qkv_bias
    if arch.family in ("qwen2", "qwen3", "qwen3_moe"):
        cfg["use_sliding_window"] = False
    cfg.update(_moe_config(arch))
    return cfg


def _moe_config(arch: ModelArch) -> dict:
    """The MoE keys of config.json (inverse of ``ModelArch.from_hf_config``'s)."""
    if arch.family == "qwen3_moe":
        return {"num_experts": arch.num_experts, "num_experts_per_tok": arch.moe_top_k,
                "moe_intermediate_size": arch.moe_ffn_hidden_size, "norm_topk_prob": arch.norm_topk_prob,
                "decoder_sparse_step": 1, "mlp_only_layers": list(arch.dense_layers)}
    if arch.family == "mixtral":  # every layer sparse: intermediate_size is the experts'
        return {"num_local_experts": arch.num_experts, "num_experts_per_tok": arch.moe_top_k,
                "intermediate_size": arch.moe_ffn_hidden_size}
    return {}


def copy_support_files(reference: Path, out: Path) -> list[str]:
    """Copy every non-weight file of ``reference`` (config, tokenizer, generation config, chat
    template, processor config, README...) into ``out``. Returns the copied names."""
    copied = []
    for path in sorted(Path(reference).iterdir()):
        if not path.is_file() or path.suffix in _WEIGHT_SUFFIXES or path.name in _WEIGHT_INDEXES:
            continue
        shutil.copy2(path, out / path.name)
        copied.append(path.name)
    return copied
