"""The evaluation's numbers against direct computations written here (math.comb, statistics),
and the results file's resumability (torn last line, corrupt line)."""

import json
import math
import random
import statistics

import pytest

from megatron_apriel.eval.metrics import ks_for, mean_ci95, pareto_frontier, pass_at_k, truncate_at_budget
from megatron_apriel.eval.results import ResultsFile, SampleRecord
from megatron_apriel.eval.summary import ordered_records, summarise
from tests.unit.conftest import make_problem


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                direct = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(direct, abs=1e-12), (n, c, k)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100), rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_interval_is_the_normal_interval_over_problems():
    rng = random.Random(0)
    values = [rng.randint(0, 8) / 8 for _ in range(30)]
    mean, low, high = mean_ci95(values)
    half = 1.959963984540054 * statistics.stdev(values) / math.sqrt(len(values))
    assert (mean, low, high) == pytest.approx((statistics.fmean(values), statistics.fmean(values) - half,
                                               statistics.fmean(values) + half), abs=1e-12)
    assert mean_ci95([0.5]) == (0.5, None, None)


def test_ks_reported():
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6] and ks_for(16)[-1] == 16


def _sweep_frontier(points):
    """Independent construction: by tokens ascending (accuracy descending on ties), keep each point
    that beats the best accuracy seen so far."""
    best, keep = -math.inf, []
    for i in sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1])):
        if points[i][1] > best:
            keep.append(i)
            best = points[i][1]
    return keep


def test_pareto_frontier():
    points = [(100, 50), (200, 70), (150, 40), (300, 70), (50, 10), (250, 80)]
    assert pareto_frontier(points) == [4, 0, 1, 5]
    rng = random.Random(1)
    for _ in range(200):
        pts = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(rng.randint(1, 8))]
        distinct = list(dict.fromkeys(pts))
        assert pareto_frontier(distinct) == _sweep_frontier(distinct), distinct


def test_truncate_at_budget():
    assert truncate_at_budget([1, 2, 3, 4], "stop", 2) == ([1, 2], "length")
    assert truncate_at_budget([1, 2, 3, 4], "stop", 4) == ([1, 2, 3, 4], "stop")


def record(pid, i, ok, length=3, finish="stop"):
    return SampleRecord(benchmark="b", problem_id=pid, sample=i, seed=i, prompt_tokens=2,
                        completion_ids=list(range(length)), finish_reason=finish, text="t",
                        outcome="correct" if ok else "wrong", success=ok, score=float(ok))


def test_summary_against_direct_formulas_and_independent_of_finish_order():
    problems = [make_problem("math", "1", pid=f"p{j}") for j in range(5)]
    rng = random.Random(2)
    ok = [rng.sample([i < j for i in range(4)], 4) for j in range(5)]  # 0..4 right: problems differ
    recs = [record(p.id, i, ok[j][i], length=rng.randint(1, 50), finish=rng.choice(["stop", "length"]))
            for j, p in enumerate(problems) for i in range(4)]
    shuffled = recs[:]
    rng.shuffle(shuffled)
    summary = summarise(problems, ordered_records(problems, {r.key: r for r in shuffled}, 4), 4)
    assert summary == summarise(problems, ordered_records(problems, {r.key: r for r in recs}, 4), 4)
    per = [sum(o) / 4 for o in ok]
    half = 1.959963984540054 * statistics.stdev(per) / math.sqrt(5)
    assert summary["pass@1"] == pytest.approx(statistics.fmean(per))
    assert summary["ci95"] == pytest.approx([statistics.fmean(per) - half, statistics.fmean(per) + half])
    assert summary["pass@k"] == pytest.approx(
        {str(k): statistics.fmean(1 - math.comb(4 - sum(o), k) / math.comb(4, k) for o in ok) for k in (2, 4)})
    lengths = [r.length for r in recs]
    assert summary["mean_output_tokens"] == pytest.approx(statistics.fmean(lengths))
    assert summary["median_output_tokens"] == statistics.median(lengths)
    assert summary["truncated_share"] == sum(r.finish_reason == "length" for r in recs) / 20
    with pytest.raises(ValueError, match="samples missing"):
        ordered_records(problems, {r.key: r for r in recs[1:]}, 4)


def test_results_file_survives_a_torn_last_line(tmp_path):
    results = ResultsFile(tmp_path / "s.jsonl")
    for i in range(3):
        results.append(record("p", i, True))
    whole = results.path.read_bytes()
    results.path.write_bytes(whole + whole.splitlines()[0][:30])  # the kill cut the 4th write short
    assert sorted(results.load(repair=False)) == [("p", 0), ("p", 1), ("p", 2)]
    assert results.path.read_bytes() != whole  # a reader leaves the file alone
    assert sorted(results.load()) == [("p", 0), ("p", 1), ("p", 2)] and results.path.read_bytes() == whole
    results.append(record("p", 3, False))
    assert sorted(results.load()) == [("p", i) for i in range(4)]


def test_results_file_corrupt_middle_line_is_an_error(tmp_path):
    results = ResultsFile(tmp_path / "s.jsonl")
    for i in range(3):
        results.append(record("p", i, True))
    lines = results.path.read_text().splitlines()
    lines[1] = json.dumps({"kind": "eval_sample", "oops": 1})
    results.path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"(?s)s.jsonl:2: not a sample record.*remove that line"):
        results.load()
