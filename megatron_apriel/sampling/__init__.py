"""Adaptive multi-domain sampling (RECIPE.md section 3)."""

from megatron_apriel.sampling.domain_sampler import (
    DOMAIN_MIX_PAPER,
    DOMAIN_MIX_PIPELINERL,
    DOMAIN_MIX_PRESETS,
    AdaptiveDomainSampler,
    SamplerConfig,
)

__all__ = ["AdaptiveDomainSampler", "SamplerConfig", "DOMAIN_MIX_PAPER", "DOMAIN_MIX_PIPELINERL",
           "DOMAIN_MIX_PRESETS"]
