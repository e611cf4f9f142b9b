"""Metric reductions are declared per key, not read off key suffixes (parallel.collectives)."""

import torch

from megatron_apriel.parallel.collectives import reduce_metrics


def t(x: float) -> torch.Tensor:
    return torch.tensor(x)


def test_each_key_reduces_as_declared_and_the_rest_is_summed():
    parts = [{"tokens": t(3), "ratio_min": t(0.9), "ratio_max": t(1.1), "share_max": t(2)},
             {"tokens": t(4), "ratio_min": t(0.8), "ratio_max": t(1.3), "share_max": t(5)}]
    out = reduce_metrics(parts, {"ratio_min": "min", "ratio_max": "max"})
    assert out["tokens"] == 7 and out["share_max"] == 7  # undeclared: summed, whatever its name says
    assert abs(out["ratio_min"] - 0.8) < 1e-6 and abs(out["ratio_max"] - 1.3) < 1e-6

