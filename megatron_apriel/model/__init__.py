"""HF config -> ModelArch -> TransformerConfig -> GPTModel. No training or distributed logic.

``ModelArch``, ``padded_vocab_size`` and ``ModelConfig`` are pure Python; the provider, which imports
torch, is loaded on first use, so the run's config and the sizing tool (``megatron_apriel.plan``)
read them without torch.
"""

from megatron_apriel.model.arch import ModelArch, padded_vocab_size
from megatron_apriel.model.config import ModelConfig

__all__ = ["ModelArch", "ModelConfig", "build_model", "padded_vocab_size"]


def __getattr__(name: str):
    if name == "build_model":
        from megatron_apriel.model import provider

        return getattr(provider, name)
    raise AttributeError(f"module 'megatron_apriel.model' has no attribute {name!r}")
