"""megatron_apriel: Megatron-Core RL post-training backend for the Apriel-1.5-OpenReasoner recipe."""

__version__ = "0.1.0"
