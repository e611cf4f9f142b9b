"""One evaluation end to end on CPU against a fake fleet at the HTTP seam (real FleetClient,
verifier pool, results file, report): scores equal the verifier called here on the saved texts,
an evaluation cut short by a failing fleet keeps its samples and, resumed, reports exactly what an
uninterrupted one reports while asking the fleet only for the missing samples."""

import asyncio
import json
import random
import re

import httpx
import pytest

from megatron_apriel.eval.benchmarks import BenchmarkSpec, load_benchmark
from megatron_apriel.eval.runner import EvalConfig
from megatron_apriel.eval.scoring import score_texts
from megatron_apriel.eval.session import check_manifest, run_benchmarks
from megatron_apriel.fleet.client import FleetClient
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.testing.fake_fleet import ByteTokenizer
from megatron_apriel.verifiers import VERIFIERS, make_verifier_pool
from megatron_apriel.verifiers.base import BEGIN_FINAL, END_FINAL
from tests.eval_fixtures import write_aime

N = 4
MAX_TOKENS = 90
_SUM = re.compile(r"What is (\d+) \+ (\d+)\?")


class SeededFleet:
    """Answers depend only on (prompt, seed), as vLLM's seeded sampling does: a filler of random
    length, then a final response, right with probability 1/2; capped at max_tokens bytes."""

    def __init__(self, fail_after: int | None = None):
        self.fail_after, self.requests = fail_after, []

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        params = body["sampling_params"]
        if self.fail_after is not None and len(self.requests) >= self.fail_after:
            return httpx.Response(400, text="the fleet is gone")
        self.requests.append(params["seed"])
        rng = random.Random(params["seed"])
        a, b = map(int, _SUM.search(bytes(body["token_ids"]).decode()).groups())
        value = a + b + (0 if rng.random() < 0.5 else rng.randint(1, 3))
        text = "x" * rng.randint(0, 60) + f"{BEGIN_FINAL}\\boxed{{{value}}}{END_FINAL}"
        tokens = list(text.encode())[: params["max_tokens"]]
        finish = "length" if len(text) > params["max_tokens"] else "stop"
        return httpx.Response(200, json={"choices": [{
            "index": 0, "finish_reason": finish, "token_ids": tokens,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.1} for t in tokens]}}]})


@pytest.fixture(scope="module")
def pool():
    pool = make_verifier_pool(1)
    yield pool
    pool.shutdown()


CFG = EvalConfig(sampling=SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95), budgets=(40, 60),
                 max_in_flight=3)


def evaluate(tmp, fleet, spec, pool, cfg=CFG):
    problems = {spec.name: load_benchmark(spec)}
    check_manifest(tmp, spec.paths[0], cfg, [spec])

    async def go():
        client = FleetClient(["http://fake"], max_attempts=1, transport=httpx.MockTransport(fleet.handle))
        try:
            return await run_benchmarks([spec], problems, client, ByteTokenizer(), pool, cfg, tmp, "fake",
                                        spec.paths[0], progress=False)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_scores_resume_and_budgets(tmp_path, pool):
    spec = BenchmarkSpec("aime", "aime", write_aime(tmp_path / "aime.jsonl"), n=N)
    straight = evaluate(tmp_path / "straight", SeededFleet(), spec, pool)

    cut = SeededFleet(fail_after=7)
    with pytest.raises(ValueError, match="benchmark aime, problem aime-.*the fleet is gone"):
        evaluate(tmp_path / "resumed", cut, spec, pool)
    samples = tmp_path / "resumed" / "samples" / "aime.jsonl"
    kept = samples.read_text().splitlines()
    assert len(kept) == 7 and not (tmp_path / "resumed" / "report.json").exists()
    again = SeededFleet()
    resumed = evaluate(tmp_path / "resumed", again, spec, pool)
    assert len(again.requests) == 6 * N - len(kept)  # only the missing samples were asked for
    assert resumed["timing"]["aime"]["new_samples"] == 6 * N - len(kept)
    for report in (straight, resumed):
        report.pop("timing")
    assert resumed == straight
    assert json.loads((tmp_path / "resumed" / "report.json").read_text())["benchmarks"] == straight["benchmarks"]

    problems = {p.id: p for p in load_benchmark(spec)}
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    ok = {(r["problem_id"], r["sample"]): VERIFIERS["math"].verify(problems[r["problem_id"]], r["text"]).success
          for r in rows}
    assert [r["success"] for r in rows] == [ok[(r["problem_id"], r["sample"])] for r in rows]
    b = straight["benchmarks"]["aime"]
    assert b["pass@1"] == pytest.approx(sum(ok.values()) / len(ok))
    assert 0 < b["pass@1"] < 1 and 0 < b["truncated_share"] < 1
    for budget in (40, 60):  # one byte per token: a trace at a budget is its first `budget` bytes
        at = [VERIFIERS["math"].verify(problems[r["problem_id"]], r["text"][:budget]).success for r in rows]
        assert b["pass@1_at_budget"][str(budget)] == pytest.approx(sum(at) / len(at))
    assert b["pass@1_at_budget"][str(MAX_TOKENS)] == b["pass@1"]
    assert b["pass@1_at_budget"]["40"] < b["pass@1"]


class CountingPool:
    """The verifier pool, counting what it is asked to score."""

    def __init__(self, pool):
        self.pool, self.scored = pool, 0

    def submit(self, fn, *args, **kwargs):
        self.scored += fn is score_texts
        return self.pool.submit(fn, *args, **kwargs)


def test_a_rerun_rescores_no_cut_trace_it_has_scored_before(tmp_path, pool):
    spec = BenchmarkSpec("aime", "aime", write_aime(tmp_path / "aime.jsonl"), n=N)
    first = evaluate(tmp_path / "out", SeededFleet(), spec, pool)
    verdicts = (tmp_path / "out" / "rescored" / "aime.jsonl").read_text().splitlines()
    assert verdicts  # traces longer than 40 or 60 tokens were cut and scored
    fleet, counting = SeededFleet(), CountingPool(pool)
    again = evaluate(tmp_path / "out", fleet, spec, counting)
    assert fleet.requests == [] and counting.scored == 0  # every sample kept, every cut trace's verdict too
    for report in (first, again):
        report.pop("timing")
    assert again == first


def test_a_rerun_with_other_settings_is_refused(tmp_path, pool):
    spec = BenchmarkSpec("aime", "aime", write_aime(tmp_path / "aime.jsonl"), n=N)
    check_manifest(tmp_path / "out", spec.paths[0], CFG, [spec])
    with pytest.raises(ValueError, match="sampling .*choose another --out"):
        check_manifest(tmp_path / "out", spec.paths[0], EvalConfig(sampling=CFG.sampling, seed=1), [spec])
    write_aime(spec.paths[0], [(1, 1)])
    with pytest.raises(ValueError, match="benchmark aime was evaluated on .*another file"):
        check_manifest(tmp_path / "out", spec.paths[0], CFG, [spec])


def test_a_failure_in_a_later_benchmark_keeps_the_earlier_report(tmp_path, pool):
    first = BenchmarkSpec("aime", "aime", write_aime(tmp_path / "aime.jsonl"), n=2)
    second = BenchmarkSpec("more", "aime", write_aime(tmp_path / "more.jsonl", [(1, 1), (2, 3)]), n=2)
    problems = {s.name: load_benchmark(s) for s in (first, second)}
    fleet = SeededFleet(fail_after=6 * 2 + 1)
    out = tmp_path / "out"

    async def go():
        client = FleetClient(["http://fake"], max_attempts=1, transport=httpx.MockTransport(fleet.handle))
        try:
            await run_benchmarks([first, second], problems, client, ByteTokenizer(), pool, CFG, out, "fake",
                                 first.paths[0], progress=False)
        finally:
            await client.aclose()

    with pytest.raises(ValueError, match="benchmark more, problem aime-.*the fleet is gone"):
        asyncio.run(go())
    report = json.loads((out / "report.json").read_text())
    assert list(report["benchmarks"]) == ["aime"] and report["benchmarks"]["aime"]["samples"] == 12
    assert len((out / "samples" / "more.jsonl").read_text().splitlines()) == 1
