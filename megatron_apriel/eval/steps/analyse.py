"""One evaluation's step analysis, end to end: select, segment, count, summarise.

    responses (`traces.load_evaluation`: correct only, or all; some benchmarks)
      -> offline: `offline.segment`                                   (steps, no labels)
         judge:   `windows.split_windows` -> cached verdicts (`cache.py`) or `judge.judge_all`
      -> tokens per step (`traces.token_counter`)
      -> per benchmark, `stats.summarise_steps` -> the report (`report.py`)

Offline and judged analyses of one evaluation live side by side in ``EVAL/steps/<name>/``
(``offline``, or ``judge-<model>``), sharing the verdict cache ``EVAL/steps/cache/``.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from megatron_apriel.eval.steps.cache import VerdictCache, verdict_digest
from megatron_apriel.eval.steps.judge import JudgeConfig, Throughput, judge_all
from megatron_apriel.eval.steps.offline import SEGMENTER_NAME, OfflineConfig, segment
from megatron_apriel.eval.steps.prompts import Prompts
from megatron_apriel.eval.steps.stats import Segmented, summarise_steps
from megatron_apriel.eval.steps.traces import Evaluation, Trace, load_evaluation, token_counter
from megatron_apriel.eval.steps.validate import Failure, Rejection, Step
from megatron_apriel.eval.steps.windows import Refusal, split_windows


@dataclass(frozen=True)
class StepsConfig:
    """What ``apriel-eval steps`` analyses, and with what."""

    benchmarks: tuple[str, ...] = ()
    """Only these benchmarks (default: every one the evaluation holds)."""
    all_responses: bool = False
    """Every response, not only the correct ones (the paper takes the correct ones)."""
    judge: Optional[JudgeConfig] = None
    """None: the offline rule-based segmenter (steps and tokens, no labels)."""
    window_chars: int = 12000
    """The longest window sent to the judge, in characters (`windows.py`)."""
    retry_failed: bool = False
    """Ask the judge again for windows whose cached verdict is a failure."""
    tokenizer: Optional[str] = None
    """A tokenizer directory, or ``whitespace``; default: the evaluated model's (`traces.py`)."""
    offline: OfflineConfig = field(default_factory=OfflineConfig)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.window_chars < 1:
            raise ValueError(f"--window-chars must be >= 1, got {self.window_chars}.")

    @property
    def name(self) -> str:
        """The analysis directory's name under ``EVAL/steps``."""
        return "offline" if self.judge is None else "judge-" + re.sub(r"[^A-Za-z0-9._-]+", "_", self.judge.model)


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="window", disable=not enabled, dynamic_ncols=True)


def _windows(traces: Sequence[Trace], cfg: StepsConfig, prompts: Prompts) -> dict[int, list[tuple[str, str]] | Refusal]:
    """Per trace (by index): its (digest, window) pairs, or the refusal of a trace too long to cut."""
    out: dict[int, list[tuple[str, str]] | Refusal] = {}
    for i, trace in enumerate(traces):
        windows = split_windows(trace.text, cfg.window_chars) if trace.text else []
        out[i] = windows if isinstance(windows, Refusal) else \
            [(verdict_digest(w, prompts, cfg.judge.model), w) for w in windows]
    return out


def judge_traces(traces: Sequence[Trace], cfg: StepsConfig, prompts: Prompts,
                 cache: VerdictCache) -> tuple[list[list[Step] | Rejection], list[int], dict]:
    """Each trace's judged steps (its windows' steps in order) or its first failure, its number of
    windows, and the judge's report section (name, prompts version, cache hits, throughput)."""
    assert cfg.judge is not None
    per_trace = _windows(traces, cfg, prompts)
    wanted = {d: w for pairs in per_trace.values() if not isinstance(pairs, Refusal) for d, w in pairs}
    known = {}
    for digest, window in wanted.items():
        verdict = cache.get(digest, window)
        if verdict is not None and not (cfg.retry_failed and verdict.failure is not None):
            known[digest] = verdict
    missing = {d: w for d, w in wanted.items() if d not in known}
    bar = _progress(len(missing), cfg.progress and bool(missing), f"judge {cfg.judge.model}")
    try:
        fresh, tally = asyncio.run(judge_all(missing, cfg=cfg.judge, prompts=prompts, cache=cache,
                                             on_done=lambda: bar.update(1))) if missing else ({}, Throughput())
    finally:
        bar.close()
    verdicts = {**known, **fresh}
    results: list[list[Step] | Rejection] = []
    for i in range(len(traces)):
        pairs = per_trace[i]
        if isinstance(pairs, Refusal):
            results.append(Rejection(Failure.TOO_LONG, pairs.reason))
            continue
        parts = [verdicts[d].result() for d, _ in pairs]
        failed = [p for p in parts if isinstance(p, Rejection)]
        results.append(failed[0] if failed else [s for part in parts for s in part])
    section = {"model": cfg.judge.model, "url": cfg.judge.url, "mode": prompts.mode, "prompts_version": prompts.version,
               "prompts_file": prompts.source, "prompts_fingerprint": prompts.fingerprint,
               "window_chars": cfg.window_chars, "windows": len(wanted), "cached_windows": len(known),
               "throughput": tally.as_dict()}
    counts = [1 if isinstance(p, Refusal) else len(p) for p in per_trace.values()]
    return results, counts, section


def analyse(path: Path, cfg: StepsConfig, prompts: Optional[Prompts]) -> dict:
    """The step report of the evaluation in ``path`` (`report.py` writes it)."""
    evaluation: Evaluation = load_evaluation(path, cfg.benchmarks, cfg.all_responses)
    counter = token_counter(path, cfg.tokenizer)
    traces = list(evaluation.traces)
    windows = [1] * len(traces)
    if cfg.judge is None:
        results: list = [segment(t.text, cfg.offline) for t in traces]
        method = {"segmenter": SEGMENTER_NAME, "labels": False, "max_step_chars": cfg.offline.max_step_chars}
    else:
        assert prompts is not None
        results, windows, judge = judge_traces(traces, cfg, prompts, VerdictCache(path / "steps" / "cache"))
        method = {"segmenter": "judge", "labels": True, "judge": judge}
    rows = [_segmented(t, r, counter, w, labelled=cfg.judge is not None) for t, r, w in zip(traces, results, windows)]
    benchmarks = {name: summarise_steps([r for r in rows if r.trace.benchmark == name], labelled=cfg.judge is not None)
                  for name in evaluation.benchmarks}
    return {"kind": "apriel_eval_steps", "schema_version": 1, "label": evaluation.label,
            "evaluation": str(path), "responses": "all" if cfg.all_responses else "correct",
            "method": method, "tokens": counter.description, "benchmarks": benchmarks,
            "traces": [_trace_row(r) for r in rows]}


def _segmented(trace: Trace, result, counter, windows: int, *, labelled: bool) -> Segmented:
    """``result``: judged steps, offline step texts, or a rejection."""
    if isinstance(result, Rejection):
        return Segmented(trace=trace, failure=result, windows=windows)
    texts = [s.text if isinstance(s, Step) else s for s in result]
    labels = tuple(s.label for s in result) if labelled else None
    return Segmented(trace=trace, steps=tuple(texts), tokens=tuple(counter.count(texts)), labels=labels,
                     windows=windows)


def _trace_row(row: Segmented) -> dict:
    t = row.trace
    out = {"benchmark": t.benchmark, "problem_id": t.problem_id, "sample": t.sample, "success": t.success,
           "windows": row.windows}
    if row.failure is not None:
        return {**out, "failure": row.failure.kind.value, "detail": row.failure.detail}
    return {**out, "steps": len(row.steps), "tokens": list(row.tokens), "labels": list(row.labels or [])}
