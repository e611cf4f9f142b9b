"""A benchmark's numbers from its scored samples (pure; formulas in `eval/metrics.py`).

The summary depends only on the set of samples, never on the order they finished in: records
are taken in problem order, then sample index, so a resumed evaluation reports exactly the
numbers of an uninterrupted one.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Sequence

from megatron_apriel.eval.metrics import ks_for, mean_ci95, pass_at_k
from megatron_apriel.eval.results import SampleRecord
from megatron_apriel.records.rollouts import Problem


def ordered_records(problems: Sequence[Problem], records: dict[tuple[str, int], SampleRecord],
                    samples: int) -> list[SampleRecord]:
    """The n records of every problem, in problem then sample order; ValueError if one is missing."""
    missing = [(p.id, i) for p in problems for i in range(samples) if (p.id, i) not in records]
    if missing:
        raise ValueError(f"{len(missing)} samples missing (first: {missing[:3]}); rerun the evaluation to finish them.")
    return [records[(p.id, i)] for p in problems for i in range(samples)]


def _pass1_stats(successes: Sequence[bool], problems: int, samples: int) -> dict:
    per_problem = [sum(successes[j * samples:(j + 1) * samples]) for j in range(problems)]
    mean, low, high = mean_ci95([c / samples for c in per_problem])
    out = {"pass@1": mean, "ci95": [low, high]}
    out["pass@k"] = {str(k): math.fsum(pass_at_k(samples, c, k) for c in per_problem) / problems
                     for k in ks_for(samples) if k > 1}
    return out


def summarise(problems: Sequence[Problem], ordered: Sequence[SampleRecord], samples: int,
              budget_success: dict[int, list[bool]] | None = None) -> dict:
    """pass@1 with its 95% CI, pass@k, output lengths, truncation and outcomes of one benchmark;
    ``budget_success`` (from `rescore_at_budgets`, same order as ``ordered``) adds pass@1 per budget."""
    assert len(ordered) == len(problems) * samples
    lengths = [r.length for r in ordered]
    out = {"problems": len(problems), "samples_per_problem": samples, "samples": len(ordered)}
    out.update(_pass1_stats([r.success for r in ordered], len(problems), samples))
    out["mean_output_tokens"] = math.fsum(lengths) / len(lengths)
    out["median_output_tokens"] = statistics.median(lengths)
    out["truncated_share"] = sum(r.truncated for r in ordered) / len(ordered)
    if any(r.turns > 1 for r in ordered):
        out["mean_turns"] = math.fsum(r.turns for r in ordered) / len(ordered)
    out["outcomes"] = dict(sorted(Counter(r.outcome.value for r in ordered).items()))
    out["verifier_errors"] = out["outcomes"].get("verifier_error", 0)
    if budget_success:
        out["pass@1_at_budget"] = {str(b): _pass1_stats(s, len(problems), samples)["pass@1"]
                                   for b, s in sorted(budget_success.items())}
    return out


BFCL_MULTI_TURN = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")


def bfcl_multi_turn_score(problems: Sequence[Problem], ordered: Sequence[SampleRecord]) -> dict:
    """BFCL's multi-turn figure, as its leaderboard computes it: the accuracy of each of the four
    categories (the share of samples the official checker passes), and their unweighted mean, in
    which a category not evaluated counts 0 (``complete`` says whether all four were)."""
    by_id = {p.id: p.metadata.get("category") for p in problems}
    hits: dict[str, list[bool]] = {}
    for r in ordered:
        hits.setdefault(by_id[r.problem_id], []).append(r.success)
    categories = {c: math.fsum(hits[c]) / len(hits[c]) for c in BFCL_MULTI_TURN if c in hits}
    return {"categories": categories, "overall": math.fsum(categories.values()) / len(BFCL_MULTI_TURN),
            "complete": len(categories) == len(BFCL_MULTI_TURN)}
