"""``apriel-eval``'s multi-turn path on BFCL v4 multi-turn rows (the bfcl-eval wheel's own files),
against a fake fleet at the HTTP seam with the tiny model's real tokenizer and chat template: each
sample is an episode of the ``bfcl_multi_turn`` environment in a real episode worker (BFCL's API
classes, the official checker's verdict). A model that plays each row's ground truth scores 1, one
that never calls a tool scores 0, and a mix scores exactly its share; the saved samples keep the
model's ids as sampled; a rerun asks the fleet for nothing."""

import asyncio
import json
import re
from pathlib import Path

import pytest

from megatron_apriel.actor.episodes import EpisodeWorkers
from megatron_apriel.eval.benchmarks import BenchmarkSpec, FormatOptions, load_benchmark
from megatron_apriel.eval.results import ResultsFile
from megatron_apriel.eval.runner import EvalConfig
from megatron_apriel.eval.session import results_path, run_benchmarks
from megatron_apriel.fleet.client import FleetClient
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.testing.fake_fleet import FakeToolFleet
from megatron_apriel.tiny.model import TinySpec, build_tokenizer
from megatron_apriel.verifiers import make_verifier_pool

pytest.importorskip("bfcl_eval")
from megatron_apriel.envs.bfcl_multi_turn import bfcl_data_dir  # noqa: E402

ROWS = 4
CATEGORY = "BFCL_v4_multi_turn_base.json"
_USER = re.compile(r"<\|user\|>(.*?)<\|eos\|>", re.DOTALL)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TinySpec(training_files=8))


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Path:
    """The first ROWS rows of BFCL's multi-turn base category, in BFCL's layout."""
    root = tmp_path_factory.mktemp("bfcl")
    data = bfcl_data_dir()
    (root / "possible_answer").mkdir()
    for sub in ("", "possible_answer"):
        lines = (data / sub / CATEGORY).read_text().splitlines()[:ROWS]
        (root / sub / CATEGORY).write_text("\n".join(lines) + "\n")
    return root / CATEGORY


def answers(bench: Path) -> list[list[list[str]]]:
    """Each row's ground truth: per user turn, its calls."""
    return [json.loads(line)["ground_truth"] for line in (bench.parent / "possible_answer" / bench.name)
            .read_text().splitlines()]


def ground_truth_policy(bench: Path, play: set[int]):
    """A model that, in rows ``play`` (by index), makes each user turn's ground-truth calls in one
    model turn, then ends the turn with a text; in the other rows it never calls a tool."""
    rows = [json.loads(line) for line in bench.read_text().splitlines()]
    truths = answers(bench)
    by_question = {row["question"][0][-1]["content"]: (i, truths[i]) for i, row in enumerate(rows)}

    def policy(context: str) -> str:
        users = _USER.findall(context)
        row, truth = by_question[users[0]]
        turn = len(users) - 1
        after_user = context[context.rindex("<|user|>"):]
        if row not in play or not truth[turn] or "<|tool|>" in after_user:
            return "Done."
        return "[" + ", ".join(truth[turn]) + "]"

    return policy


def evaluate(bench: Path, out: Path, tokenizer, fleet: FakeToolFleet) -> dict:
    spec = BenchmarkSpec(name="bfcl_base", format="bfcl_multi_turn", paths=(bench,),
                         options=FormatOptions(max_trajectory_tokens=100_000))
    problems = {spec.name: load_benchmark(spec)}
    cfg = EvalConfig(sampling=SamplingConfig(max_tokens=4000, temperature=1.0), max_in_flight=2)

    async def go():
        client = FleetClient(["http://fake"], transport=fleet.transport())
        try:
            return await run_benchmarks([spec], problems, client, tokenizer, pool, cfg, out, "fake", bench,
                                        progress=False, episodes=episodes)
        finally:
            await client.aclose()

    pool, episodes = make_verifier_pool(1), EpisodeWorkers(1)
    try:
        report = asyncio.run(go())
        return {**report["benchmarks"][spec.name], "bfcl": report["bfcl_multi_turn"],
                "md": (out / "report.md").read_text()}
    finally:
        pool.shutdown()
        episodes.shutdown()


@pytest.mark.parametrize("play", [range(ROWS), (), (0, 2)], ids=["ground_truth", "no_calls", "half"])
def test_a_bfcl_episode_per_sample_scores_what_the_model_played(bench, tokenizer, tmp_path, play):
    fleet = FakeToolFleet(tokenizer, ground_truth_policy(bench, set(play)))
    report = evaluate(bench, tmp_path / "out", tokenizer, fleet)
    assert report["problems"] == ROWS and report["samples"] == ROWS  # BFCL's one sample per entry
    assert report["pass@1"] == pytest.approx(len(play) / ROWS)
    assert "pass@1_at_budget" not in report  # a cut trajectory is not one the episode saw
    # BFCL's overall multi-turn figure: the four categories' unweighted mean, a missing one counting 0
    assert report["bfcl"] == {"categories": {"multi_turn_base": pytest.approx(len(play) / ROWS)},
                              "overall": pytest.approx(len(play) / ROWS / 4), "complete": False}
    assert f"BFCL v4 multi-turn overall {100 * len(play) / ROWS / 4:.1f}%: base {100 * len(play) / ROWS:.1f}" \
        in report["md"]
    records = sorted(ResultsFile(results_path(tmp_path / "out", "bfcl_base")).load().values(), key=lambda r: r.key)
    assert [r.success for r in records] == [i in play for i in range(ROWS)]
    for i, (record, truth) in enumerate(zip(records, answers(bench))):
        # the first model turn, as the fleet sampled it, opens the saved ids (token in, token out)
        firsts = [ids for prompt, choices in fleet.sampled.items() if len(prompt) == record.prompt_tokens
                  for ids in choices]
        assert any(record.completion_ids[:len(ids)].tolist() == ids for ids in firsts)
        # a played user turn with calls takes two model turns (the calls, then the text), any other one
        assert record.turns == sum(2 if calls and i in play else 1 for calls in truth)
        assert not record.truncated
    asked = fleet.requests
    again = evaluate(bench, tmp_path / "out", tokenizer, fleet)
    assert fleet.requests == asked and again["pass@1"] == report["pass@1"]  # resumed: nothing generated again


def test_a_version_1_sample_reads_as_one_turn_and_an_unknown_version_is_refused():
    from megatron_apriel.eval.results import SampleRecord

    line = {"kind": "eval_sample", "schema_version": 1, "benchmark": "b", "problem_id": "p", "sample": 0, "seed": 1,
            "prompt_tokens": 3, "completion_ids": [5, 6], "finish_reason": "stop", "text": "x",
            "outcome": "correct", "success": True, "score": 1.0}
    assert SampleRecord.model_validate(line).turns == 1
    with pytest.raises(ValueError, match="schema_version 3"):
        SampleRecord.model_validate({**line, "schema_version": 3})
