"""The decoder architecture, read from a Hugging Face ``config.json`` (pure: no torch).

Families: Mistral (Apriel-1.5's text decoder, inside a LLaVA wrapper whose ``text_config`` is
read), Llama, Qwen2 (qkv bias) and Qwen3 (qk-norm). Llama-3 RoPE scaling (``rope_type: llama3``,
Llama-3.1/3.2/3.3) is mapped onto Megatron-Core's own; a Mistral sliding window is accepted and
must then be at least ``trainer.seq_len`` (:meth:`ModelArch.check_sequence_length`), where it never
masks anything. Anything the model would silently get wrong (other RoPE scalings, YaRN, shorter
windows, biases we do not map) is refused with the reason.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

FAMILIES = ("mistral", "llama", "qwen2", "qwen3")
_WRAPPERS = ("llava", "mistral3")  # multimodal wrappers whose text decoder we train
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama-3 RoPE constants Megatron-Core's ``RotaryEmbedding`` applies (only the factor is an
argument, 0.16 to 0.19); they are Llama-3.1/3.2/3.3's values."""
log = logging.getLogger("megatron_apriel")


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
    rope_scaling_factor: Optional[float] = None
    """Llama-3 RoPE scaling factor (``rope_type: llama3``, with LLAMA3_FIXED's constants); null: plain RoPE."""
    sliding_window: Optional[int] = None
    """Mistral's attention window (null: none). Only valid when trainer.seq_len <= it (see
    check_sequence_length); the model then attends to the full sequence, as the window allows."""

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
        if self.rope_scaling_factor is not None and self.rope_scaling_factor < 1:
            raise ValueError(f"model.arch.rope_scaling_factor must be >= 1 or null, got {self.rope_scaling_factor}.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model.arch.sliding_window must be >= 1 or null, got {self.sliding_window}.")

    def check_sequence_length(self, seq_len: int) -> None:
        """Refuse a sliding window shorter than the training sequence; log that a longer one is inert."""
        if self.sliding_window is None:
            return
        if seq_len > self.sliding_window:
            raise ValueError(
                f"sliding_window={self.sliding_window} is shorter than trainer.seq_len={seq_len}: the HF model "
                f"attends only to the last {self.sliding_window} tokens, the Megatron model to all of them. Set "
                f"trainer.seq_len<={self.sliding_window} (with a prompt and rewards.max_len that fit), or use a "
                "checkpoint whose config sets sliding_window to null.")
        log.info("sliding_window=%d >= trainer.seq_len=%d: the window never masks a token here, so the model "
                 "attends to the full sequence, as the HF model does", self.sliding_window, seq_len)

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
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", family == "mistral") else None
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
            rope_scaling_factor=_llama3_factor(cfg),
            sliding_window=window,
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


def _rope_scaling(cfg: dict) -> dict:
    """The RoPE scaling block: ``rope_scaling`` (transformers < 5) or ``rope_parameters`` (>= 5)."""
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def _llama3_factor(cfg: dict) -> Optional[float]:
    scaling = _rope_scaling(cfg)
    return float(scaling["factor"]) if scaling.get("rope_type", scaling.get("type")) == "llama3" else None


def _check_rope_scaling(cfg: dict) -> None:
    scaling = _rope_scaling(cfg)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return
    if rope_type == "yarn":
        raise ValueError(
            "rope scaling 'yarn' is not supported: Megatron-Core (0.16 to 0.19) builds YaRN only for multi-latent "
            "attention (GPTModel's yarn path reads yarn_* settings that TransformerConfig does not declare), so a "
            "dense GQA model cannot get it through the public API. Use a checkpoint without YaRN (e.g. the base "
            "model's config.json without rope_scaling, training within original_max_position_embeddings).")
    if rope_type != "llama3":
        raise ValueError(f"rope scaling {rope_type!r} is not supported; plain RoPE and 'llama3' are mapped.")
    if "factor" not in scaling:
        raise ValueError("rope_scaling of type llama3 has no factor; is config.json complete?")
    wrong = {k: scaling.get(k) for k, v in LLAMA3_FIXED.items() if float(scaling.get(k, v)) != v}
    if wrong:
        raise ValueError(
            f"llama3 rope scaling with {wrong} is not supported: Megatron-Core's RotaryEmbedding applies "
            f"{LLAMA3_FIXED} (Llama-3.1/3.2/3.3's values) and takes only the factor.")


def _refuse_unsupported(cfg: dict, family: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (SwiGLU with silu only).")
    _check_rope_scaling(cfg)
    window = cfg.get("sliding_window")
    if window is not None and family != "mistral" and cfg.get("use_sliding_window", False):
        raise ValueError(
            f"use_sliding_window=true (sliding_window={window}) is not supported for {family}: its window applies "
            "to some layers only (max_window_layers), which the Megatron model does not map. Use a config with "
            "use_sliding_window=false.")
    if cfg.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported (no MLP biases are mapped).")
