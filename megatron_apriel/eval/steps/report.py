"""The step report of one evaluation: ``EVAL/steps/<name>/report.json``, ``report.md``, the console.

``report.json``::

    {"kind": "apriel_eval_steps", "schema_version": 1, "label", "evaluation", "responses": correct|all,
     "method": {"segmenter": "offline-rules-v1"|"judge", "labels": bool,
                "judge"?: {model, url, mode, prompts_version, prompts_file, prompts_fingerprint, window_chars,
                           windows, cached_windows,
                           throughput: {requests, windows_judged, wall_s, requests_per_s,
                                        completion_tokens, completion_tokens_per_s,
                                        completion_tokens_per_window, completion_tokens_per_char,
                                        attempt_failures}}},
     "tokens": what a token is here,
     "benchmarks": {NAME: {responses, accepted, failed, failure_share, failure_reasons, windowed_responses,
                           steps_per_response: {mean, median, ci95}, tokens_per_step: {mean, median, ci95},
                           labels?: {LABEL: {share, ci95}}, non_productive_share?, strategic_share?}},
     "traces": [{benchmark, problem_id, sample, success, windows, steps, tokens, labels | failure, detail}]}

``throughput`` describes this invocation only (a rerun served from the cache asks nothing); its
completion tokens (what the judge is paid for, retries included) per window judged and per
character of those windows are the judge's cost.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_apriel.files import atomic_write

STEPS_KIND = "apriel_eval_steps"


def _num(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ci(entry: dict, scale: float = 1.0) -> str:
    """`` [low, high]`` of ``entry["ci95"]`` times ``scale``; empty when there is none."""
    low, high = entry["ci95"]
    return f" [{scale * low:.1f}, {scale * high:.1f}]" if low is not None else ""


def _pct(entry: dict | None) -> str:
    return f"{100 * entry['share']:.1f}{_ci(entry, 100)}" if entry else "-"


def _stat(entry: dict | None) -> str:
    return f"{_num(entry['mean'])}{_ci(entry)} / {_num(entry['median'])}" if entry else "-"


COLUMNS = ("benchmark", "responses", "failed", "steps/response mean [CI] / median", "tokens/step mean [CI] / median",
           "other %", "verif+back+subgoal+backward %")


def table_rows(report: dict) -> list[list[str]]:
    rows = []
    for name, b in report["benchmarks"].items():
        failed = f"{b['failed']} ({_num(100 * b['failure_share'] if b['failure_share'] is not None else None)}%)"
        rows.append([name, str(b["responses"]), failed, _stat(b.get("steps_per_response")),
                     _stat(b.get("tokens_per_step")), _pct(b.get("non_productive_share")),
                     _pct(b.get("strategic_share"))])
    return rows


def _table(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join("| " + " | ".join(r) + " |" for r in [rows[0], ["---"] * len(rows[0])] + rows[1:])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths)] + lines[1:])


def method_line(report: dict) -> str:
    m = report["method"]
    if m["segmenter"] != "judge":
        how = f"offline rule-based segmenter `{m['segmenter']}` (steps only, no labels)"
    else:
        j, t = m["judge"], m["judge"]["throughput"]
        how = (f"judge `{j['model']}`, {j.get('mode', 'copy')} mode, prompts v{j['prompts_version']}, windows of "
               f"{j['window_chars']} characters; {j['windows']} windows, {j['cached_windows']} from the cache, "
               f"{t['requests']} requests in {t['wall_s']:.1f}s ({_num(t['requests_per_s'], 2)} requests/s, "
               f"{_num(t['completion_tokens_per_s'], 0)} completion tokens/s); cost: {t['completion_tokens']} "
               f"completion tokens, {_num(t.get('completion_tokens_per_window'), 0)} per window, "
               f"{_num(t.get('completion_tokens_per_char'), 3)} per trace character")
    return f"{report['label']}: {report['responses']} responses; {how}; tokens: {report['tokens']}."


def console_table(report: dict) -> str:
    return method_line(report) + "\n" + _table([list(COLUMNS)] + table_rows(report), markdown=False)


def markdown(report: dict) -> str:
    body = f"# Reasoning steps of `{report['label']}`\n\n{method_line(report)}\n\n"
    body += _table([list(COLUMNS)] + table_rows(report), markdown=True) + "\n"
    for name, b in report["benchmarks"].items():
        if b.get("labels"):
            body += f"\n## {name}: step labels (% of steps, 95% CI)\n\n"
            body += _table([["label", "share %"]] + [[k, _pct(v)] for k, v in b["labels"].items()], markdown=True)
            body += "\n"
        if b["failure_reasons"]:
            body += f"\n{name}: failed responses by reason: {b['failure_reasons']}\n"
    return body


def write_steps_report(directory: Path, report: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / "report.json", json.dumps(report, indent=1) + "\n")
    atomic_write(directory / "report.md", markdown(report))
    return directory / "report.json"
