"""RMSNorm for Megatron's local layer spec, usable under sequence parallelism.

Megatron's local spec builds torch norms through ``WrappedTorchNorm``, which refuses sequence
parallelism. Under it each tensor-parallel rank normalises its own slice of the tokens, so a norm's
weight gradient is a partial sum that must be added over the TP ranks; Megatron does that for
weights marked ``sequence_parallel`` (``finalize_model_grads``), as Transformer Engine's norms are.
This class is torch's RMSNorm with that mark, so the CPU path runs sequence parallelism as the
GPU path does (MoE layers under tensor parallelism need it).
"""

from __future__ import annotations

import torch


class LocalRMSNorm(torch.nn.RMSNorm):
    """Built as Megatron builds its norms: ``(config, hidden_size, eps, ...)``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError(f"LocalRMSNorm builds RMSNorm only, the model asks for {config.normalization}.")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
