"""The decoder architecture, read from a Hugging Face ``config.json`` (pure: no torch).

Families: Mistral (Apriel-1.5's text decoder, inside a LLaVA wrapper whose ``text_config`` is
read), Llama, Qwen2 (qkv bias) and Qwen3 (qk-norm). Anything the model would silently get wrong
(rope scaling, sliding windows, biases we do not map) is refused with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

FAMILIES = ("mistral", "llama", "qwen2", "qwen3")
_WRAPPERS = ("llava", "mistral3")  # multimodal wrappers whose text decoder we train


@dataclass
class ModelArch:
    """A dense pre-norm decoder: RMSNorm, SwiGLU MLP, GQA attention with RoPE."""

    family: str = "llama"
    """mistral, llama, qwen2 or qwen3: decides qkv bias / qk-norm and the HF parameter names."""
    vocab_size: int = 512
    """True vocabulary size (the HF one). The Megatron embedding is padded above it for TP."""
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    """Per-head size; may differ from hidden_size / num_heads (Apriel: 128 with hidden 5120, 32 heads)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model.arch.family={self.family!r} is not supported; use one of {FAMILIES}.")
        for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.arch.{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.arch.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})."
            )

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArch":
        """Build from a parsed HF config.json (a LLaVA/Mistral3 wrapper's ``text_config`` is used)."""
        if cfg.get("model_type") in _WRAPPERS:
            if "text_config" not in cfg:
                raise ValueError(f"{cfg['model_type']} config has no text_config; is the checkpoint complete?")
            cfg = cfg["text_config"]
        family = cfg.get("model_type")
        if family not in FAMILIES:
            raise ValueError(
                f"unsupported HF model_type {family!r}; supported: {FAMILIES} (and {_WRAPPERS} wrappers)."
            )
        _refuse_unsupported(cfg, family)
        heads = cfg["num_attention_heads"]
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(_rope_theta(cfg)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelArch":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file} not found: model.hf_path must be a Hugging Face model directory.")
        return cls.from_hf_config(json.loads(config_file.read_text()))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's embedding rows: the vocabulary padded to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}  # transformers >= 5 moves rope_theta here
    return cfg.get("rope_theta") or params.get("rope_theta") or 10000.0


def _refuse_unsupported(cfg: dict, family: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (SwiGLU with silu only).")
    scaling = cfg.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) or (cfg.get("rope_parameters") or {}).get("rope_type")
    if rope_type not in (None, "default"):
        raise ValueError(f"rope scaling {rope_type!r} is not supported yet; only plain RoPE is mapped.")
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", family == "mistral")
    if window is not None and uses_window:
        raise ValueError(
            f"sliding_window={window} is not supported: the Megatron model would attend to the full "
            "context. Use a checkpoint whose config sets sliding_window to null."
        )
    if cfg.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported (no MLP biases are mapped).")
