"""Process groups and rank arithmetic. The only package (with model/wrap and weight_sync) that
reads Megatron's parallel state; everything else receives a ``ParallelContext``."""

from megatron_apriel.parallel.dims import ParallelConfig, ParallelDims
from megatron_apriel.parallel.groups import ParallelContext, destroy_parallel, init_parallel

__all__ = ["ParallelConfig", "ParallelDims", "ParallelContext", "init_parallel", "destroy_parallel"]
