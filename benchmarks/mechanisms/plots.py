"""Figures of ``benchmarks/recipe_mechanisms.py`` (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

STYLES = {"static_iid": "--", "adaptive_iid": "-", "static": "--", "adaptive": "-", "adaptive_trained": "-.",
          "standard": "--", "dap": "-"}
"""The baseline dashed, the recipe's mechanism solid, the trained count dash-dotted."""
VARIANT_COLORS = {"static_iid": "tab:orange", "adaptive_iid": "tab:orange", "static": "tab:purple",
                  "adaptive": "tab:purple", "adaptive_trained": "tab:brown"}
COLORS = {"math": "tab:blue", "code": "tab:red", "logic": "tab:green", "easy": "tab:blue", "hard": "tab:red"}


def mix_figure(runs: dict, path: Path) -> Path:
    """Left: share of completed rollouts per domain as the run goes, static (dashed) against
    adaptive (solid), i.i.d. draws, targets dotted. Middle: the largest |share - target| over the
    domains, every variant, of completed rollouts, and of trained ones (thin) for the adaptive
    sampler counting completed and trained rollouts. Right: the adaptive sampler's probabilities
    (i.i.d. draws)."""
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    shown = [n for n in ("static_iid", "adaptive_iid") if n in runs] or list(runs)
    for name in shown:
        trace = runs[name]["trace"]
        xs = [n for n, _, _ in trace]
        for d, row in runs[name]["domains"].items():
            left.plot(xs, [100 * s[d] for _, s, _ in trace], STYLES[name], color=COLORS[d], label=f"{d} ({name})")
            left.axhline(100 * row["target"], color=COLORS[d], linestyle=":", linewidth=1)
    for name, run in runs.items():
        targets = {d: row["target"] for d, row in run["domains"].items()}
        xs = [n for n, _, _ in run["trace"]]
        gap = [100 * max(abs(s[d] - t) for d, t in targets.items()) for _, s, _ in run["trace"]]
        middle.plot(xs, gap, STYLES[name], color=VARIANT_COLORS[name], label=name)
        if name in ("adaptive", "adaptive_trained") and run.get("trained_trace"):
            xs = [n for n, _ in run["trained_trace"]]
            gap = [100 * max(abs(s[d] - t) for d, t in targets.items()) for _, s in run["trained_trace"]]
            middle.plot(xs, gap, STYLES[name], color=VARIANT_COLORS[name], linewidth=0.8, label=f"{name}, trained")
    adaptive = runs.get("adaptive_iid", runs.get("adaptive"))
    if adaptive is not None:
        xs = [n for n, _, _ in adaptive["trace"]]
        for d in adaptive["domains"]:
            right.plot(xs, [p[d] for _, _, p in adaptive["trace"]], color=COLORS[d], label=d)
    left.set(xlabel="completed rollouts", ylabel="share of completed rollouts (%)",
             title="realised mix (dotted: target)")
    left.legend(fontsize=7, ncol=2)
    middle.set(xlabel="completed rollouts", ylabel="largest |share - target| (pp)", yscale="log", ylim=(1e-2, 100),
               title="gap to the target mix (thin: of trained rollouts)")
    middle.legend(fontsize=8)
    for axis in (middle, right):
        axis.axvline(50, color="grey", linewidth=0.8)
    right.set(xlabel="completed rollouts", ylabel="sampling probability", title="adaptive sampler's probabilities")
    right.legend(fontsize=8)
    return _save(fig, path)


def dap_figure(runs: dict, path: Path) -> Path:
    """Mean length and success of the rollouts each step read, per difficulty, standard penalty (dashed)
    vs DAP."""
    fig, (length, success) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        style = STYLES[name]
        for level, series in run["by_difficulty"].items():
            steps = [s["step"] for s in series]
            length.plot(steps, [s["length"] for s in series], style, color=COLORS[level], label=f"{level} ({name})")
            success.plot(steps, [s["success"] for s in series], style, color=COLORS[level], label=f"{level} ({name})")
    length.set(xlabel="step", ylabel="mean completion tokens", title="length of the rollouts each step read")
    success.set(xlabel="step", ylabel="success", title="their success")
    length.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
