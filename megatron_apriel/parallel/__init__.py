"""Process groups and rank arithmetic, and which GPUs each process of a node gets (``devices.py``).
The only package (with model/wrap and weight_sync) that reads Megatron's parallel state; everything
else receives a ``ParallelContext``.

``ParallelConfig`` and ``ParallelDims`` are pure Python (the run's config and the sizing tool
read them without torch); the groups, which import torch, are loaded on first use."""

from megatron_apriel.parallel.dims import ParallelConfig, ParallelDims

__all__ = ["ParallelConfig", "ParallelDims", "ParallelContext", "init_parallel", "destroy_parallel"]


def __getattr__(name: str):
    if name in ("ParallelContext", "init_parallel", "destroy_parallel"):
        from megatron_apriel.parallel import groups

        return getattr(groups, name)
    raise AttributeError(f"module 'megatron_apriel.parallel' has no attribute {name!r}")
