"""The numbers of a step analysis, as pure functions of the segmented responses of one benchmark.

Over the R accepted responses (response i: S_i steps, T_i tokens in all, n_i(l) steps labelled l):

- steps per response: mean (1/R) sum S_i, with its 95% interval by the normal approximation over
  responses (`metrics.mean_ci95`, as pass@1's), and median;
- tokens per step: mean sum T_i / sum S_i (every step of every response weighs the same), and
  median over all steps;
- the share of label l: sum n_i(l) / sum S_i; non-productive: the share of ``other``; strategic:
  the combined share of `prompts.STRATEGIC`;
- the 95% interval of a ratio (tokens per step, each share): percentile bootstrap over responses
  (``BOOTSTRAP`` resamples of the R responses with replacement, seed 0; none for R < 2);
- failures: the responses without an accepted segmentation, their share of all selected
  responses and their count per reason. They are in no other number: a failed response is
  counted there, never dropped silently nor repaired.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megatron_apriel.eval.metrics import mean_ci95
from megatron_apriel.eval.steps.prompts import LABELS, NON_PRODUCTIVE, STRATEGIC
from megatron_apriel.eval.steps.traces import Trace
from megatron_apriel.eval.steps.validate import Rejection

BOOTSTRAP = 2000


@dataclass(frozen=True)
class Segmented:
    """One response, segmented (``steps``, ``tokens``; ``labels`` None offline) or failed."""

    trace: Trace
    steps: tuple[str, ...] = ()
    tokens: tuple[int, ...] = ()
    labels: Optional[tuple[str, ...]] = None
    failure: Optional[Rejection] = None
    windows: int = 1


def _bootstrap_ratio(num_R: np.ndarray, den_R: np.ndarray) -> list[Optional[float]]:
    """95% percentile interval of sum(num) / sum(den) over responses resampled with replacement."""
    if len(num_R) < 2:
        return [None, None]
    idx_BR = np.random.default_rng(0).integers(0, len(num_R), size=(BOOTSTRAP, len(num_R)))
    ratio_B = num_R[idx_BR].sum(axis=1) / np.maximum(den_R[idx_BR].sum(axis=1), 1)
    low, high = np.percentile(ratio_B, [2.5, 97.5])
    return [float(low), float(high)]


def _label_shares(accepted: Sequence[Segmented], steps_R: np.ndarray) -> dict:
    counts_RL = np.array([[s.labels.count(label) for label in LABELS] for s in accepted], dtype=float)
    total = max(steps_R.sum(), 1)
    shares = {label: {"share": float(counts_RL[:, j].sum() / total), "ci95": _bootstrap_ratio(counts_RL[:, j], steps_R)}
              for j, label in enumerate(LABELS)}
    strategic_R = counts_RL[:, [LABELS.index(label) for label in STRATEGIC]].sum(axis=1)
    return {"labels": shares, "non_productive_share": shares[NON_PRODUCTIVE],
            "strategic_share": {"share": float(strategic_R.sum() / total),
                                "ci95": _bootstrap_ratio(strategic_R, steps_R)}}


def summarise_steps(rows: Sequence[Segmented], labelled: bool) -> dict:
    """The report's numbers for one benchmark's responses (see the module docstring)."""
    accepted = [r for r in rows if r.failure is None]
    failed = [r for r in rows if r.failure is not None]
    out: dict = {"responses": len(rows), "accepted": len(accepted), "failed": len(failed),
                 "failure_share": len(failed) / len(rows) if rows else None,
                 "failure_reasons": dict(sorted(Counter(r.failure.kind.value for r in failed).items())),
                 "windowed_responses": sum(r.windows > 1 for r in rows)}
    if not accepted:
        return out
    steps_R = np.array([len(r.steps) for r in accepted], dtype=float)
    tokens_R = np.array([sum(r.tokens) for r in accepted], dtype=float)
    mean, low, high = mean_ci95(list(steps_R))
    out["steps_per_response"] = {"mean": mean, "median": float(statistics.median(steps_R)), "ci95": [low, high]}
    all_steps = [t for r in accepted for t in r.tokens]  # empty only if every response is the empty text
    out["tokens_per_step"] = {"mean": float(tokens_R.sum() / max(steps_R.sum(), 1)),
                              "median": float(statistics.median(all_steps)) if all_steps else None,
                              "ci95": _bootstrap_ratio(tokens_R, steps_R)}
    if labelled:
        out.update(_label_shares(accepted, steps_R))
    return out
