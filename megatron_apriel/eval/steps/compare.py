"""``apriel-eval steps --compare A B``: the paper's comparison (Appendix D), base A against trained B.

Per benchmark both hold: steps per response and tokens per step (mean, median; B against A in
%), the share of each label, the non-productive and the strategic share (B - A in points), and
the failure share. `compare_figure` draws, side by side, steps per response, tokens per step
(bars: means, with their 95% intervals) and the label distribution (grouped bars, with
intervals); without labels (the offline segmenter) the third panel says so.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from megatron_apriel.eval.steps.prompts import LABELS  # noqa: E402

NO_LABELS = "no labels: offline segmenter\n(run with --judge-url for them)"


def _rel(a, b) -> str:
    return "-" if a in (None, 0) or b is None else f"{100 * (b - a) / a:+.0f}%"


def _pts(a, b) -> str:
    return "-" if a is None or b is None else f"{100 * (b - a):+.1f} pts"


def _get(b: dict, *keys):
    for key in keys:
        b = b.get(key) if isinstance(b, dict) else None
    return b


def comparison_rows(a: dict, b: dict, name: str) -> list[list[str]]:
    """Rows (metric, A, B, change) of benchmark ``name`` of two step reports."""
    ba, bb = a["benchmarks"][name], b["benchmarks"][name]
    rows = []
    for metric, key in (("steps per response", "steps_per_response"), ("tokens per step", "tokens_per_step")):
        for stat in ("mean", "median"):
            x, y = _get(ba, key, stat), _get(bb, key, stat)
            rows.append([f"{metric} ({stat})", "-" if x is None else f"{x:.1f}", "-" if y is None else f"{y:.1f}",
                         _rel(x, y)])
    shares = [(f"{label} %", ("labels", label, "share")) for label in LABELS] if ba.get("labels") and bb.get("labels") \
        else []
    shares += [("non-productive (other) %", ("non_productive_share", "share")),
               ("verification+backtracking+subgoal+backward %", ("strategic_share", "share")),
               ("failed responses %", ("failure_share",))]
    for metric, keys in shares:
        x, y = _get(ba, *keys), _get(bb, *keys)
        rows.append([metric, "-" if x is None else f"{100 * x:.1f}", "-" if y is None else f"{100 * y:.1f}",
                     _pts(x, y)])
    return rows


def common_benchmarks(a: dict, b: dict) -> list[str]:
    names = [n for n in a["benchmarks"] if n in b["benchmarks"]]
    if not names:
        raise ValueError(f"the two evaluations share no benchmark ({sorted(a['benchmarks'])} and "
                         f"{sorted(b['benchmarks'])}); compare evaluations of the same benchmarks.")
    return names


def comparison_text(a: dict, b: dict, labels: tuple[str, str]) -> str:
    out = []
    for name in common_benchmarks(a, b):
        rows = [["metric", labels[0], labels[1], "change"]] + comparison_rows(a, b, name)
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        out.append(f"{name}: {labels[0]} ({a['benchmarks'][name]['accepted']} responses) vs {labels[1]} "
                   f"({b['benchmarks'][name]['accepted']} responses)")
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _err(entries: list[dict | None], value: str) -> tuple[list[float], list[list[float]]]:
    """Bar heights and matplotlib yerr (distances below and above) of ``entries``."""
    heights, below, above = [], [], []
    for e in entries:
        v = (e or {}).get(value) or 0.0
        low, high = (e or {}).get("ci95") or [None, None]
        heights.append(v)
        below.append(v - low if low is not None else 0.0)
        above.append(high - v if high is not None else 0.0)
    return heights, [below, above]


def compare_figure(a: dict, b: dict, name: str, labels: tuple[str, str]):
    """Steps per response | tokens per step | label shares (%) of benchmark ``name``, A and B."""
    ba, bb = a["benchmarks"][name], b["benchmarks"][name]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1, 1, 3]})
    fig.suptitle(f"{name}: reasoning steps, {labels[0]} vs {labels[1]}")
    for ax, key, title in ((axes[0], "steps_per_response", "steps per response"),
                           (axes[1], "tokens_per_step", "tokens per step")):
        heights, yerr = _err([ba.get(key), bb.get(key)], "mean")
        ax.bar(list(labels), heights, yerr=yerr, color=["C0", "C1"], capsize=4)
        ax.set(title=f"{title} (mean, 95% CI)")
    ax = axes[2]
    if ba.get("labels") and bb.get("labels"):
        width = 0.4
        for k, (report_b, label) in enumerate(((ba, labels[0]), (bb, labels[1]))):
            heights, yerr = _err([report_b["labels"][lab] for lab in LABELS], "share")
            ax.bar([i + (k - 0.5) * width for i in range(len(LABELS))], [100 * h for h in heights], width,
                   yerr=[[100 * e for e in side] for side in yerr], label=label, color=f"C{k}", capsize=2)
        ax.set_xticks(range(len(LABELS)), [lab.replace("_", "\n") for lab in LABELS], fontsize=8)
        ax.set(title="step labels (% of steps, 95% CI)", ylabel="% of steps")
        ax.legend()
    else:
        ax.text(0.5, 0.5, NO_LABELS, ha="center", va="center", transform=ax.transAxes)
        ax.set(title="step labels", xticks=[], yticks=[])
    fig.tight_layout()
    return fig


def plot_comparison(a: dict, b: dict, labels: tuple[str, str], out: Path) -> list[Path]:
    """One PNG per common benchmark, ``OUT/steps_<benchmark>.png``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in common_benchmarks(a, b):
        fig = compare_figure(a, b, name, labels)
        paths.append(out / f"steps_{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
