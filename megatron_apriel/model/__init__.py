"""HF config -> ModelArch -> TransformerConfig -> GPTModel. No training or distributed logic."""

from megatron_apriel.model.arch import ModelArch
from megatron_apriel.model.provider import ModelConfig, build_model, padded_vocab_size

__all__ = ["ModelArch", "ModelConfig", "build_model", "padded_vocab_size"]
