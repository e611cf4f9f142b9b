"""The decoder architecture, read from a Hugging Face ``config.json`` (pure: no torch).

Families: Mistral (Apriel-1.5's text decoder, inside a LLaVA wrapper whose ``text_config`` is
read), Llama, Qwen2 (qkv bias) and Qwen3 (qk-norm); and two mixtures of experts, Qwen3-MoE
(Qwen3's attention; softmax top-k routing, renormalised when ``norm_topk_prob``; dense layers
where ``mlp_only_layers`` / ``decoder_sparse_step`` say) and Mixtral (Mistral's attention, every
layer sparse, renormalised top-k). What the MoE families of other checkpoints add and we do not
map (shared experts, sigmoid or grouped routing, router biases, router jitter) is refused with the
reason. Llama-3 RoPE scaling (``rope_type: llama3``,
Llama-3.1/3.2/3.3) is mapped onto Megatron-Core's own; a Mistral sliding window is accepted and
must then be at least ``trainer.seq_len`` (:meth:`ModelArch.check_sequence_length`), where it never
masks anything. Anything the model would silently get wrong (other RoPE scalings, YaRN, shorter
windows, biases we do not map) is refused with the reason.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

FAMILIES = ("mistral", "llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")
_WRAPPERS = ("llava", "mistral3")  # multimodal wrappers whose text decoder we train
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama-3 RoPE constants Megatron-Core's ``RotaryEmbedding`` applies (only the factor is an
argument, 0.16 to 0.19); they are Llama-3.1/3.2/3.3's values."""
log = logging.getLogger("megatron_apriel")


@dataclass
class ModelArch:
    """A pre-norm decoder: RMSNorm, GQA attention with RoPE, and SwiGLU MLPs, dense or a mixture
    of SwiGLU experts (``num_experts > 0``) with a softmax top-k router."""

    family: str = "llama"
    """mistral, llama, qwen2, qwen3, qwen3_moe or mixtral: decides qkv bias / qk-norm, experts
    and the HF parameter names."""
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
    num_experts: int = 0
    """Experts per MoE layer; 0: a dense model (every MLP is one SwiGLU of ffn_hidden_size)."""
    moe_top_k: int = 0
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """Intermediate size of each expert (HF ``moe_intermediate_size``; Mixtral's intermediate_size)."""
    norm_topk_prob: bool = True
    """Renormalise the k chosen experts' softmax weights to sum to 1 (Mixtral, Qwen3-30B-A3B);
    false: the weights are the softmax over all experts, unrenormalised."""
    dense_layers: list[int] = field(default_factory=list)
    """Layers whose MLP is dense (ffn_hidden_size) in a MoE model (Qwen3-MoE's mlp_only_layers and
    decoder_sparse_step); every other layer is sparse."""

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
        self._check_moe()

    def _check_moe(self) -> None:
        if (self.family in MOE_FAMILIES) != (self.num_experts > 0):
            raise ValueError(f"model.arch.num_experts={self.num_experts} does not fit family {self.family!r}: the "
                             f"MoE families {MOE_FAMILIES} need num_experts >= 1, the dense ones 0.")
        if not self.is_moe:
            if self.dense_layers:
                raise ValueError("model.arch.dense_layers applies to MoE models only; leave it empty.")
            return
        if self.family == "mixtral" and (self.dense_layers or not self.norm_topk_prob):
            raise ValueError("a Mixtral model has no dense layers and renormalises its top-k: leave "
                             "model.arch.dense_layers empty and norm_topk_prob true.")
        if not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(f"model.arch.moe_top_k must be in [1, num_experts={self.num_experts}], "
                             f"got {self.moe_top_k}.")
        if self.moe_top_k == 1 and self.norm_topk_prob:
            raise ValueError("moe_top_k=1 with norm_topk_prob=true (every token's one expert weighted 1) is not "
                             "supported: Megatron's top-1 router weights the expert by its softmax probability.")
        if self.moe_ffn_hidden_size < 1:
            raise ValueError(f"model.arch.moe_ffn_hidden_size must be >= 1, got {self.moe_ffn_hidden_size}.")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.dense_layers)) != len(self.dense_layers):
            raise ValueError(f"model.arch.dense_layers={self.dense_layers} must be distinct layer indices in "
                             f"[0, {self.num_layers}).")
        if not self.moe_layers:
            raise ValueError("model.arch.dense_layers lists every layer: the model has no MoE layer; use the "
                             "dense family instead.")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        """The sparse layers' global indices, in order (empty for a dense model)."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

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
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", family in ("mistral", "mixtral")) else None
        heads = cfg["num_attention_heads"]
        return cls(
            **_moe_fields(cfg, family),
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],  # Mixtral's: its experts' (no dense MLP)
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(_rope_theta(cfg)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
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
    _refuse_unsupported_moe(cfg, family)
    window = cfg.get("sliding_window")
    if window is not None and family not in ("mistral", "mixtral") and cfg.get("use_sliding_window", False):
        raise ValueError(
            f"use_sliding_window=true (sliding_window={window}) is not supported for {family}: its window applies "
            "to some layers only (max_window_layers), which the Megatron model does not map. Use a config with "
            "use_sliding_window=false.")
    if cfg.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported (no MLP biases are mapped).")


def _moe_fields(cfg: dict, family: str) -> dict:
    """The ModelArch MoE fields of a HF config (empty for a dense family)."""
    if family == "qwen3_moe":
        step = cfg.get("decoder_sparse_step", 1)
        only = set(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(cfg["num_hidden_layers"])
                 if i in only or step < 1 or (i + 1) % step != 0]  # transformers' rule for a sparse layer
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers >= 5 writes the latter
        return dict(num_experts=experts, moe_top_k=cfg["num_experts_per_tok"],
                    moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)
    if family == "mixtral":
        return dict(num_experts=cfg["num_local_experts"], moe_top_k=cfg["num_experts_per_tok"],
                    moe_ffn_hidden_size=cfg["intermediate_size"], norm_topk_prob=True)
    return {}


def _refuse_unsupported_moe(cfg: dict, family: str) -> None:
    """What a MoE config may carry that the Megatron model would not reproduce."""
    if family not in MOE_FAMILIES:
        return
    shared = cfg.get("shared_expert_intermediate_size") or cfg.get("n_shared_experts")
    if shared:
        raise ValueError(f"{family} with shared experts (shared_expert_intermediate_size / n_shared_experts="
                         f"{shared}) is not supported: only routed experts are mapped.")
    scoring = cfg.get("scoring_func", "softmax")
    if scoring != "softmax" or cfg.get("topk_group") or cfg.get("n_group"):
        raise ValueError(f"router scoring {scoring!r} with groups (n_group={cfg.get('n_group')}) is not supported: "
                         "only softmax top-k routing is mapped.")
    if cfg.get("router_jitter_noise"):
        raise ValueError(f"router_jitter_noise={cfg['router_jitter_noise']} is not supported: vLLM never adds "
                         "router noise, so training with it would route differently from sampling. Set it to 0.")
    if cfg.get("q_lora_rank") or cfg.get("kv_lora_rank"):
        raise ValueError("multi-latent attention (q_lora_rank / kv_lora_rank) is not supported.")
