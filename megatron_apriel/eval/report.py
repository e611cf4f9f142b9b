"""The evaluation report: ``report.json`` (everything), ``report.md`` and the console table.

``report.json``::

    {"kind": "apriel_eval_report", "schema_version": 1, "label": ..., "checkpoint": ...,
     "sampling": {temperature, top_p, max_tokens, stop, seed},
     "benchmarks": {NAME: {format, path, problems, samples_per_problem, samples, pass@1, ci95: [lo, hi],
                           pass@k: {k: ...}, mean_output_tokens, median_output_tokens, truncated_share,
                           outcomes: {...}, verifier_errors, pass@1_at_budget: {budget: ...},
                           mean_turns (multi-turn)}},
     "bfcl_multi_turn": {categories: {category: accuracy}, overall, complete},   # with BFCL multi-turn
     "timing": {NAME: {wall_s, new_samples}}}

Everything but ``timing`` is a function of the saved samples: a resumed evaluation writes the
same report, ``timing`` apart (it describes the last invocation only).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_apriel.files import atomic_write

REPORT_KIND = "apriel_eval_report"
COLUMNS = ("benchmark", "n", "pass@1 (95% CI)", "pass@k", "mean tok", "median tok", "truncated", "wall s")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def table_rows(report: dict) -> list[list[str]]:
    rows = []
    for name, b in report["benchmarks"].items():
        low, high = b["ci95"]
        ci = f"{_pct(b['pass@1'])} [{_pct(low)}, {_pct(high)}]" if low is not None else _pct(b["pass@1"])
        passk = ", ".join(f"@{k} {_pct(v)}" for k, v in b["pass@k"].items()) or "-"
        wall = report.get("timing", {}).get(name, {}).get("wall_s")
        rows.append([name, f"{b['problems']}x{b['samples_per_problem']}", ci, passk, f"{b['mean_output_tokens']:.0f}",
                     f"{b['median_output_tokens']:.0f}", f"{100 * b['truncated_share']:.1f}%",
                     "-" if wall is None else f"{wall:.0f}"])
    return rows


def bfcl_line(report: dict) -> str:
    """BFCL's multi-turn overall figure and its categories, or "" without BFCL multi-turn."""
    b = report.get("bfcl_multi_turn")
    if not b:
        return ""
    parts = ", ".join(f"{c.removeprefix('multi_turn_')} {_pct(v)}" for c, v in b["categories"].items())
    missing = "" if b["complete"] else " (categories not evaluated count 0, as BFCL's leaderboard)"
    return f"BFCL v4 multi-turn overall {_pct(b['overall'])}%: {parts}{missing}"


def console_table(report: dict) -> str:
    rows = [list(COLUMNS)] + table_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(filter(None, [*lines, bfcl_line(report)]))


def markdown(report: dict) -> str:
    s = report["sampling"]
    head = (f"# Evaluation of `{report['label']}`\n\ncheckpoint `{report['checkpoint']}`; "
            f"temperature {s['temperature']}, top_p {s['top_p']}, max tokens {s['max_tokens']}, seed {s['seed']}. "
            "pass@1 is the mean over the n samples of each problem, in %, with its 95% confidence interval over "
            "problems.\n\n")
    rows = [list(COLUMNS), ["---"] * len(COLUMNS)] + table_rows(report)
    bfcl = bfcl_line(report)
    return head + "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n" + (f"\n{bfcl}\n" if bfcl else "")


def write_report(out_dir: Path, report: dict) -> None:
    atomic_write(out_dir / "report.json", json.dumps(report, indent=2) + "\n")
    atomic_write(out_dir / "report.md", markdown(report))


def read_report(path: str | Path) -> dict:
    """A ``report.json`` (or the output directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such file; give an apriel-eval output directory or its report.json.")
    report = json.loads(path.read_text())
    if report.get("kind") != REPORT_KIND:
        raise ValueError(f"{path} is not an apriel-eval report (kind {report.get('kind')!r}).")
    return report
