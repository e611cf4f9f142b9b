"""The numbers of an evaluation, as pure functions of the scored samples.

For a benchmark of P problems with n samples each, c_i of them correct on problem i:

- pass@1 = (1/P) sum_i c_i / n: the mean over the n samples, averaged over problems;
- its 95% confidence interval: pass@1 +- z * s / sqrt(P), with s the sample standard deviation
  (ddof 1) of the per-problem means c_i / n and z = 1.96 (normal approximation; problems are the
  unit of sampling, the n samples of one problem only sharpen its mean). Undefined for P < 2;
- pass@k (unbiased, Chen et al. 2021) = (1/P) sum_i [1 - C(n - c_i, k) / C(n, k)], for k <= n,
  computed as 1 - prod_{j = n - c + 1}^{n} (1 - k / j) (no large binomials);
- the Pareto frontier of (mean output tokens, accuracy) points: the points that no other point
  dominates (as few or fewer tokens and as high or higher accuracy, one of the two strictly);
- a trace at a token budget B: its first B tokens, truncated (finish reason ``length``) when it
  had more; a trace within the budget is unchanged.
"""

from __future__ import annotations

import math
from typing import Sequence

Z_95 = 1.959963984540054
"""Two-sided 95% quantile of the standard normal."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n, c of them
    correct, is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:
        return 1.0
    prod = 1.0
    for j in range(n - c + 1, n + 1):
        prod *= 1.0 - k / j
    return 1.0 - prod


def mean_ci95(values: Sequence[float]) -> tuple[float, float | None, float | None]:
    """``(mean, low, high)`` of ``values`` (the per-problem means); low/high None for fewer than 2."""
    if not values:
        raise ValueError("mean_ci95 of no values")
    m = math.fsum(values) / len(values)
    if len(values) < 2:
        return m, None, None
    var = math.fsum((v - m) ** 2 for v in values) / (len(values) - 1)
    half = Z_95 * math.sqrt(var / len(values))
    return m, m - half, m + half


def ks_for(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, 8, ... up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == n else ks + [n]


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated ``(tokens, accuracy)`` points (fewer tokens and higher accuracy
    are better), ordered by tokens (then accuracy, descending)."""
    def dominates(a, b) -> bool:
        return a[0] <= b[0] and a[1] >= b[1] and (a[0] < b[0] or a[1] > b[1])

    keep = [i for i, p in enumerate(points) if not any(dominates(q, p) for q in points)]
    return sorted(keep, key=lambda i: (points[i][0], -points[i][1]))


def truncate_at_budget(token_ids: Sequence[int], finish_reason: str, budget: int) -> tuple[list[int], str]:
    """The trace as a generation capped at ``budget`` tokens would have left it."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}.")
    if len(token_ids) > budget:
        return [int(t) for t in token_ids[:budget]], "length"
    return [int(t) for t in token_ids], finish_reason

