"""One evaluation's output directory and its loop over benchmarks.

``OUT/manifest.json`` records what defines the samples (checkpoint, sampling protocol and seed,
and per benchmark its format, file checksum and format options). A rerun into the same
directory must agree with it, so that resumed samples and new ones come from the same protocol;
benchmarks may be added, and samples per problem changed (sample i is the same draw whatever n).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Sequence

from megatron_apriel.actor.trajectory import ChatTokens
from megatron_apriel.actor.turns import Turns
from megatron_apriel.eval.benchmarks import BenchmarkSpec
from megatron_apriel.eval.report import REPORT_KIND, write_report
from megatron_apriel.eval.results import BudgetVerdicts, ResultsFile
from megatron_apriel.eval.runner import BenchmarkRun, EvalConfig, evaluate_benchmark, rescore_at_budgets
from megatron_apriel.eval.summary import bfcl_multi_turn_score, ordered_records, summarise
from megatron_apriel.fleet.client import FleetClient
from megatron_apriel.records.rollouts import Problem

MANIFEST = "manifest.json"


def results_path(out: Path, name: str) -> Path:
    return out / "samples" / f"{name}.jsonl"


def check_manifest(out: Path, checkpoint: Path, cfg: EvalConfig, specs: Sequence[BenchmarkSpec]) -> dict:
    """Write or extend ``OUT/manifest.json``; ValueError naming the difference when a rerun disagrees."""
    wanted = {"checkpoint": str(checkpoint.resolve()), "sampling": cfg.identity(),
              "benchmarks": {s.name: s.identity() for s in specs}}
    path = out / MANIFEST
    if path.is_file():
        have = json.loads(path.read_text())
        for key in ("checkpoint", "sampling"):
            if have[key] != wanted[key]:
                raise ValueError(f"{out} holds an evaluation with {key} {have[key]}, not {wanted[key]}: rerun with "
                                 "the same settings to resume it, or choose another --out.")
        for name, identity in wanted["benchmarks"].items():
            if name in have["benchmarks"] and have["benchmarks"][name] != identity:
                raise ValueError(f"{out}: benchmark {name} was evaluated on {have['benchmarks'][name]}, now "
                                 f"{identity} (another file or options): give it another name or use another --out.")
        wanted["benchmarks"] = {**have["benchmarks"], **wanted["benchmarks"]}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=2) + "\n")
    return wanted


def _multi_turn(spec: BenchmarkSpec, client: FleetClient, tokenizer, cfg: EvalConfig, episodes) -> dict:
    """``BenchmarkRun``'s multi-turn fields for ``spec`` (none for a single-turn benchmark)."""
    if spec.environment is None:
        return {}
    if episodes is None:
        raise ValueError(f"benchmark {spec.name} ({spec.format}) runs episodes: give run_benchmarks an episode host.")
    budget = spec.options.max_trajectory_tokens or cfg.sampling.max_tokens
    turns = Turns(client, ChatTokens(tokenizer), episodes, max_turns=spec.options.max_turns, budget=budget)
    return {"turns": turns, "environment": spec.environment}


def _progress_bar(name: str, total: int, done: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=name, unit="sample", disable=not enabled, dynamic_ncols=True)


async def run_benchmarks(specs: Sequence[BenchmarkSpec], problems: dict[str, list[Problem]], client: FleetClient,
                         tokenizer, pool: Executor, cfg: EvalConfig, out: Path, label: str, checkpoint: Path,
                         progress: bool = True, episodes=None) -> dict:
    """Evaluate each benchmark in turn; the report is rewritten after each one (a later failure
    keeps the earlier benchmarks' reports as well as every written sample). ``episodes`` hosts the
    episodes of multi-turn benchmarks (``actor.episodes.EpisodeWorkers``); their samples are
    scored by their episodes, at the sampling's own budget only (a cut trajectory is not a
    trajectory the episode saw)."""
    report = {"kind": REPORT_KIND, "schema_version": 1, "label": label, "checkpoint": str(checkpoint),
              "sampling": cfg.identity(), "benchmarks": {}, "timing": {}}
    episodic: tuple[list[Problem], list] = ([], [])  # every multi-turn benchmark's problems and samples
    for spec in specs:
        results = ResultsFile(results_path(out, spec.name))
        done = results.load()
        already = sum(1 for k in done if k[1] < spec.samples)
        bar = _progress_bar(spec.name, len(problems[spec.name]) * spec.samples, already, progress)
        multi_turn = _multi_turn(spec, client, tokenizer, cfg, episodes)
        run = BenchmarkRun(spec.name, problems[spec.name], spec.samples, results, client, tokenizer, pool, cfg,
                           on_sample=lambda record: bar.update(1), **multi_turn)
        start = time.monotonic()
        try:
            records = await evaluate_benchmark(run, done)
        finally:
            bar.close()
        wall = time.monotonic() - start
        ordered = ordered_records(run.problems, records, spec.samples)
        by_id = {p.id: p for p in run.problems}
        budgets = None
        if spec.environment is None:
            verdicts = BudgetVerdicts(out / "rescored" / f"{spec.name}.jsonl")
            budgets = rescore_at_budgets(ordered, by_id, tokenizer, pool, cfg.used_budgets, verdicts)
        summary = summarise(run.problems, ordered, spec.samples, budgets)
        report["benchmarks"][spec.name] = {"format": spec.format, "path": spec.source, **summary}
        if spec.format == "bfcl_multi_turn":
            episodic[0].extend(run.problems)
            episodic[1].extend(ordered)
            report["bfcl_multi_turn"] = bfcl_multi_turn_score(*episodic)
        report["timing"][spec.name] = {"wall_s": wall, "new_samples": len(ordered) - already}
        write_report(out, report)
    return report
