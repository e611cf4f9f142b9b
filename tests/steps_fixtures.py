"""Finished evaluations written by hand, for the ``apriel-eval steps`` tests: the samples files and
report.json that ``apriel-eval run`` leaves (no manifest: tokens are counted as whitespace words)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_apriel.eval.results import ResultsFile, SampleRecord
from megatron_apriel.records.rollouts import Outcome


def write_evaluation(out: Path, label: str, traces: dict[str, list[tuple[str, bool]]]) -> Path:
    """``traces``: per benchmark, (text, correct) of each response (problem i, sample 0)."""
    for bench, rows in traces.items():
        results = ResultsFile(out / "samples" / f"{bench}.jsonl")
        for i, (text, correct) in enumerate(rows):
            results.append(SampleRecord(benchmark=bench, problem_id=f"{bench}-{i:02d}", sample=0, seed=i,
                                        prompt_tokens=3, completion_ids=np.arange(1, 4, dtype=np.int32),
                                        finish_reason="stop", text=text,
                                        outcome=Outcome.CORRECT if correct else Outcome.WRONG, success=correct,
                                        score=float(correct)))
    (out / "report.json").write_text(json.dumps({"kind": "apriel_eval_report", "label": label, "benchmarks": {}}))
    return out
