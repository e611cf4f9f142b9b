"""Plots (PNG) of evaluations and of a training run.

- `frontier_figure`: per benchmark, pass@1 against mean output tokens, one labelled point per
  evaluated model, the Pareto frontier (`metrics.pareto_frontier`) drawn through the points that
  no other model beats on both axes;
- `lengths_figure`: per benchmark, the histogram of response lengths of each model;
- `budget_figure`: per benchmark, pass@1 when every trace is cut at a token budget and rescored;
- `training_curves_figure`: reward and response length per domain, and the domain mix of completed
  and of trained rollouts against its target, from a run directory's TensorBoard log
  (``RUN/tensorboard``: the tags ``domain/<d>/reward``, ``domain/<d>/length``, ``mix/<d>/realised``,
  ``mix/<d>/trained``, ``mix/<d>/target``).

Each ``*_figure`` returns the matplotlib Figure (tests read its axes); ``plot_*`` save PNGs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from megatron_apriel.eval.metrics import pareto_frontier  # noqa: E402
from megatron_apriel.eval.report import read_report  # noqa: E402
from megatron_apriel.eval.results import ResultsFile  # noqa: E402
from megatron_apriel.run_dir import RunDir

X_TOKENS = "mean output tokens"
Y_PASS1 = "pass@1 (%)"
FRONTIER_GID = "pareto_frontier"

Entry = tuple[str, dict]
"""(label, report.json as a dict)."""


def _benchmarks(entries: Sequence[Entry]) -> list[str]:
    names: list[str] = []
    for _, report in entries:
        names += [n for n in report["benchmarks"] if n not in names]
    return names


def _axes(count: int, title: str):
    fig, axes = plt.subplots(1, max(count, 1), figsize=(5 * max(count, 1), 4), squeeze=False)
    fig.suptitle(title)
    return fig, list(axes[0])


def frontier_figure(entries: Sequence[Entry]):
    names = _benchmarks(entries)
    fig, axes = _axes(len(names), "accuracy vs output tokens (Pareto frontier dashed)")
    for ax, name in zip(axes, names):
        points, labels = [], []
        for label, report in entries:
            b = report["benchmarks"].get(name)
            if b is None:
                continue
            point = (b["mean_output_tokens"], 100 * b["pass@1"])
            ax.scatter([point[0]], [point[1]], label=label, zorder=3)
            ax.annotate(label, point, textcoords="offset points", xytext=(5, 5), fontsize=8)
            points.append(point)
            labels.append(label)
        front = [points[i] for i in pareto_frontier(points)]
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="gray", gid=FRONTIER_GID, zorder=2)
        ax.set(title=name, xlabel=X_TOKENS, ylabel=Y_PASS1)
        ax.ticklabel_format(useOffset=False)
        ax.margins(0.15)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _lengths(out_dir: Path, name: str, samples: int) -> list[int]:
    records = ResultsFile(out_dir / "samples" / f"{name}.jsonl").load(repair=False)
    return [r.length for key, r in sorted(records.items()) if key[1] < samples]


def lengths_figure(entries: Sequence[tuple[str, dict, Path]]):
    """``entries``: (label, report, its output directory, where the samples are)."""
    names = _benchmarks([(label, report) for label, report, _ in entries])
    fig, axes = _axes(len(names), "response lengths")
    for ax, name in zip(axes, names):
        for label, report, out_dir in entries:
            if name in report["benchmarks"]:
                lengths = _lengths(out_dir, name, report["benchmarks"][name]["samples_per_problem"])
                ax.hist(lengths, bins=30, alpha=0.5, label=label)
        ax.set(title=name, xlabel="output tokens", ylabel="samples")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def budget_figure(entries: Sequence[Entry]):
    names = _benchmarks(entries)
    fig, axes = _axes(len(names), "accuracy vs token budget (traces cut and rescored)")
    for ax, name in zip(axes, names):
        for label, report in entries:
            at = report["benchmarks"].get(name, {}).get("pass@1_at_budget")
            if at:
                budgets = sorted(at, key=int)
                ax.plot([int(b) for b in budgets], [100 * at[b] for b in budgets], "o-", label=label)
        ax.set(title=name, xlabel="token budget", ylabel=Y_PASS1)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_run(out_dir: Path, report: dict) -> list[Path]:
    """The plots of one evaluation, into ``OUT/plots``."""
    entry = (report["label"], report)
    return [_save(lengths_figure([(*entry, out_dir)]), out_dir / "plots" / "lengths.png"),
            _save(budget_figure([entry]), out_dir / "plots" / "budget.png")]


def _only(report: dict, benchmarks: Sequence[str]) -> dict:
    return {**report, "benchmarks": {n: b for n, b in report["benchmarks"].items() if n in benchmarks}}


def plot_comparison(results: Sequence[str | Path], labels: Sequence[str] | None, out: Path,
                    benchmarks: Sequence[str] = ()) -> list[Path]:
    """Frontier, lengths and budget plots over several evaluations (output directories), of
    every benchmark they hold or of ``benchmarks`` only."""
    if labels is not None and len(labels) != len(results):
        raise ValueError(f"{len(labels)} labels for {len(results)} results; give one label per result.")
    reports = [read_report(r) for r in results]
    if benchmarks:
        held = {n for r in reports for n in r["benchmarks"]}
        unknown = sorted(set(benchmarks) - held)
        if unknown:
            raise ValueError(f"benchmarks {unknown} are in none of the results; they hold {sorted(held)}.")
        reports = [_only(r, benchmarks) for r in reports]
    names = list(labels) if labels else [r["label"] for r in reports]
    dirs = [Path(r) if Path(r).is_dir() else Path(r).parent for r in results]
    entries = list(zip(names, reports))
    return [_save(frontier_figure(entries), out / "frontier.png"),
            _save(lengths_figure([(n, r, d) for n, r, d in zip(names, reports, dirs)]), out / "lengths.png"),
            _save(budget_figure(entries), out / "budget.png")]


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the TensorBoard event files directly in ``log_dir``: (step, value) lists."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not log_dir.is_dir() or not any(log_dir.glob("events.out.tfevents.*")):
        raise ValueError(f"{log_dir}: no TensorBoard event files; give a run directory (it logs to RUN/tensorboard).")
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def training_curves_figure(run_dir: Path):
    scalars = read_scalars(RunDir(run_dir).tensorboard)
    panels = (("domain/{d}/reward", "reward", "reward per domain"),
              ("domain/{d}/length", "response length (tokens)", "mean response length per domain"),
              ("mix/{d}/realised", "domain share", "domain mix: completed (dashed: trained, dotted: target)"))
    fig, axes = _axes(3, f"training curves: {Path(run_dir).name}")
    domains = sorted({tag.split("/")[1] for tag in scalars if tag.startswith(("domain/", "mix/"))})
    if not domains:
        raise ValueError(f"{run_dir}/tensorboard has no domain/<d>/ or mix/<d>/ scalars "
                         f"(tags: {sorted(scalars)[:10]}).")
    for ax, (pattern, ylabel, title) in zip(axes, panels):
        for d in domains:
            series = scalars.get(pattern.format(d=d))
            if series:
                line, = ax.plot([s for s, _ in series], [v for _, v in series], label=d)
                if pattern.startswith("mix/"):
                    for tag, style in (("trained", "--"), ("target", ":")):
                        other = scalars.get(f"mix/{d}/{tag}")  # trained: absent from runs of earlier releases
                        if other:
                            ax.plot([s for s, _ in other], [v for _, v in other], style, color=line.get_color())
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_training_curves(run_dir: Path, out: Path) -> Path:
    return _save(training_curves_figure(run_dir), Path(out) / "training_curves.png")
