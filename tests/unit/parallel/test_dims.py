"""Parallel sizes resolved from the world (pure): what is left is data parallelism, with context
parallelism taking its share; impossible splits fail naming the keys."""

import pytest

from megatron_apriel.parallel.dims import ParallelConfig, ParallelDims


@pytest.mark.parametrize("world, cfg, dp, expert_dp", [
    (8, ParallelConfig(tp=2, cp=2), 2, 8),
    (8, ParallelConfig(tp=2, pp=2, cp=2), 1, 4),
    (16, ParallelConfig(tp=2, cp=2, ep=4), 4, 4),
    (4, ParallelConfig(cp=4), 1, 4),
])
def test_context_parallel_ranks_come_out_of_the_data_parallel_ones(world, cfg, dp, expert_dp):
    dims = ParallelDims.resolve(cfg, world)
    assert (dims.dp, dims.cp, dims.world, dims.expert_dp) == (dp, cfg.cp, world, expert_dp)


@pytest.mark.parametrize("world, cfg, message", [
    (6, ParallelConfig(tp=2, cp=2), "not divisible by tp\\*cp\\*pp = 2\\*2\\*1 = 4"),
    (8, ParallelConfig(cp=2, ep=16), "parallel.ep=16 must divide tp\\*cp\\*dp = 1\\*2\\*4 = 8"),
])
def test_impossible_splits_name_the_keys(world, cfg, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims.resolve(cfg, world)
