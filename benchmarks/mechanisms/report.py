"""What ``benchmarks/recipe_mechanisms.py`` reads back from a finished run directory: the durable
stream (every group, in the order the actor finished them), the per-step metrics (which groups
each step read) and the composed config. Nothing here is logged specially for the benchmark.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from megatron_apriel.records.stream import StreamReader, StreamWriter
from megatron_apriel.rewards import length_penalty, task_reward
from megatron_apriel.sampling import AdaptiveDomainSampler


def stream(run: Path) -> list:
    return StreamReader(run / "rollouts").read_all()


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]


def config(run: Path) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def read_by_step(run: Path, groups: list) -> list[list]:
    """The groups each step read: step k read the stream's groups [cursor_{k-1}, cursor_k)."""
    out, start = [], 0
    for row in metrics(run):
        end = int(row["rollout/cursor"])
        out.append(groups[start:end])
        start = end
    return out


def trained_by_step(run: Path, groups: list) -> list[list]:
    """The groups each step trained: those it read that were not dropped and are within
    ``rollout.max_lag`` of the step (the trainer's own rule)."""
    max_lag = config(run)["rollout"]["max_lag"]
    return [[g for g in read if g.dropped is None and k - g.min_version <= max_lag]
            for k, read in enumerate(read_by_step(run, groups))]


# --- the domain mix ------------------------------------------------------------------------------

def mix_report(run: Path, weights: dict[str, float], min_completions: int, adaptive: bool) -> dict:
    """Per domain: target share, realised share of completed and of trained rollouts, |error| in
    percentage points at the end, averaged over the run after the warm-up and at most over its
    second half (by completions); the same at the end and averaged after the warm-up for the
    trained rollouts; the share of its groups dropped (zero advantage); and the trace of cumulative
    completed shares and of the sampler's probabilities, completion by completion, and of
    cumulative trained shares, trained group by trained group (placed at the completed rollouts
    up to it). The warm-up is the first ``min_completions`` completed rollouts.

    The probabilities are recomputed by feeding the stream's groups, in order, to a fresh sampler
    with the run's ``actor.sampler.count`` (the actor calls ``record_completion`` in that order,
    saying whether each group is dropped); its final counts, both of them, must equal the sampler
    state the actor saved with its last stream segment."""
    groups = stream(run)
    count = config(run)["actor"]["sampler"].get("count", "completed")  # runs of earlier releases: completed
    sampler = AdaptiveDomainSampler(weights, min_completions=min_completions if adaptive else 10**12, count=count)
    targets, counts = sampler.targets, {d: 0 for d in weights}
    trace = []  # (completed rollouts, shares, probabilities)
    for g in groups:
        counts[g.domain] += len(g.rollouts)
        sampler.record_completion(g.domain, len(g.rollouts), trained=g.dropped is None)
        total = sum(counts.values())
        trace.append((total, {d: counts[d] / total for d in weights}, sampler.probabilities()))
    saved = StreamWriter(run / "rollouts").last_snapshot().sampler
    assert saved["counts"] == counts, f"the stream's completions {counts} differ from the actor's {saved}"
    if saved["version"] >= 3:  # a run of an earlier release saved no trained counts
        assert saved["trained"] == sampler.counts("trained"), f"the stream's kept rollouts differ from {saved}"
    steps = trained_by_step(run, groups)
    trained_trace = _trained_trace(groups, steps, weights)
    trained = {d: 0 for d in weights}
    for g in (g for step in steps for g in step):
        trained[g.domain] += len(g.rollouts)
    after = [shares for n, shares, _ in trace if n >= min_completions]
    trained_after = [shares for n, shares in trained_trace if n >= min_completions]
    second_half = [shares for n, shares, _ in trace if n >= trace[-1][0] / 2]
    rows = {}
    for d, t in targets.items():
        completed = counts[d] / sum(counts.values())
        rows[d] = {"target": t, "completed": completed, "trained": trained[d] / sum(trained.values()),
                   "err_end_pp": 100 * abs(completed - t),
                   "err_after_warmup_pp": _mean_gap_pp(after, d, t),
                   "err_max_second_half_pp": 100 * max(abs(s[d] - t) for s in second_half),
                   "err_trained_pp": 100 * abs(trained[d] / sum(trained.values()) - t),
                   "err_trained_after_warmup_pp": _mean_gap_pp(trained_after, d, t),
                   "length": float(np.mean([r.length for g in groups if g.domain == d for r in g.rollouts])),
                   "success": float(np.mean([r.success for g in groups if g.domain == d for r in g.rollouts])),
                   "dropped": float(np.mean([g.dropped is not None for g in groups if g.domain == d])),
                   **_timings(groups, d)}
    after_warmup = [row["err_trained_after_warmup_pp"] for row in rows.values()]
    return {"domains": rows, "count": count, "completed": sum(counts.values()), "trained": sum(trained.values()),
            "trained_err_end_pp": max(row["err_trained_pp"] for row in rows.values()),
            "trained_err_after_warmup_pp": None if None in after_warmup else max(after_warmup),
            "trace": trace, "trained_trace": trained_trace}


def _trained_trace(groups: list, steps: list[list], weights: dict[str, float]) -> list[tuple[int, dict]]:
    """(completed rollouts so far, cumulative trained shares) after each trained group, in stream order."""
    seqs = {g.seq for step in steps for g in step}
    completed, counts, out = 0, {d: 0 for d in weights}, []
    for g in groups:
        completed += len(g.rollouts)
        if g.seq in seqs:
            counts[g.domain] += len(g.rollouts)
            total = sum(counts.values())
            out.append((completed, {d: counts[d] / total for d in weights}))
    return out


def _mean_gap_pp(shares: list[dict], domain: str, target: float) -> float | None:
    return 100 * float(np.mean([abs(s[domain] - target) for s in shares])) if shares else None


def _timings(groups: list, domain: str) -> dict[str, float]:
    """Mean seconds per group of a domain: generation (vLLM) and verification, as the actor timed them."""
    mine = [g.timings for g in groups if g.domain == domain]
    return {"generate_s": float(np.mean([t.generate_s for t in mine])),
            "verify_s": float(np.mean([t.verify_s for t in mine]))}


# --- DAP ------------------------------------------------------------------------------------------

def dap_identity(run: Path) -> tuple[int, int]:
    """(correct rollouts checked, of them exactly equal): each correct rollout's recorded reward
    must be R + s^gamma * P(l) (DAP) or R + P(l) (standard), recomputed from the recorded fields
    (verifier score, finish reason, length, the group's successes) in the same float operations;
    a rollout cut at the budget keeps the full penalty (the hard-cap guard), so it is not counted."""
    rewards = config(run)["rewards"]
    checked = equal = 0
    for g in stream(run):
        s = sum(r.success for r in g.rollouts) / len(g.rollouts)
        for r in g.rollouts:
            truncated = r.finish_reason == "length"
            if not r.success or (truncated and r.length >= rewards["max_len"]):
                continue
            scale = s ** rewards["gamma"] if rewards["dap_enabled"] else 1.0
            expected = task_reward(r.score, truncated) + scale * length_penalty(r.length, rewards["max_len"],
                                                                                 rewards["buffer"])
            checked += 1
            equal += r.reward == expected
    return checked, equal


def by_difficulty(run: Path, level_of) -> dict[str, list[dict]]:
    """Per difficulty, per step: mean and p90 length and success of the rollouts the step read
    (all of them: the zero-advantage filter drops all-solved and all-failed groups, which would
    bias success towards 1/2)."""
    out: dict[str, list[dict]] = {}
    for k, step in enumerate(read_by_step(run, stream(run))):
        for level in sorted({level_of(g.problem_id) for g in step}):
            rollouts = [r for g in step if level_of(g.problem_id) == level for r in g.rollouts]
            lengths = np.array([r.length for r in rollouts])
            out.setdefault(level, []).append({"step": k, "length": float(lengths.mean()),
                                              "p90": float(np.percentile(lengths, 90)),
                                              "success": float(np.mean([r.success for r in rollouts])),
                                              "rollouts": len(rollouts)})
    return out


def window(series: list[dict], key: str, first: bool, n: int = 10) -> float:
    """Mean of ``key`` over the first (or last) ``n`` steps, weighted by rollouts."""
    part = series[:n] if first else series[-n:]
    weights = np.array([s["rollouts"] for s in part], dtype=float)
    return float(np.average([s[key] for s in part], weights=weights))
