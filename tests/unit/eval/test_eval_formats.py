"""The evaluation benchmarks in their public formats (hand-written files, tests/eval_fixtures.py):
what each converter reads, GPQA's recorded shuffle, LiveCodeBench's private tests, bad input."""

import base64
import csv
import json
import pickle
import zlib
from pathlib import Path

import pytest

from megatron_apriel.eval.benchmarks import BenchmarkSpec, load_benchmark
from megatron_apriel.verifiers import VERIFIERS
from megatron_apriel.verifiers.multiple_choice import MultipleChoiceVerifier
from tests.eval_fixtures import GPQA_COLUMNS, SUMS, lcb_rows, write_all, write_gpqa, write_lcb
from tests.unit.conftest import apriel
from tools.prepare_data import convert_file


@pytest.fixture
def files(tmp_path):
    return write_all(tmp_path / "bench")


def load(fmt, path, **options):
    from megatron_apriel.eval.benchmarks import FormatOptions

    return load_benchmark(BenchmarkSpec("b", fmt, path, options=FormatOptions(**options)))


def test_aime_jsonl(files):
    problems = load("aime", files["aime"])
    assert [p.id for p in problems] == [f"aime-{i + 1}" for i in range(len(SUMS))]
    assert [p.reference for p in problems] == [str(a + b) for a, b in SUMS]
    assert all(p.domain == "math" and p.prompt[0]["content"].startswith(f"What is {a} + {b}?")
               for p, (a, b) in zip(problems, SUMS))
    gold = apriel(rf"\boxed{{{SUMS[0][0] + SUMS[0][1]}}}")
    assert VERIFIERS["math"].verify(problems[0], gold).success


def test_gpqa_csv_shuffle_is_seeded_recorded_and_keeps_the_answer(files, tmp_path):
    many = [(a, b) for a in range(5) for b in range(5)]
    path = write_gpqa(tmp_path / "many.csv", many)
    by_seed = {seed: load("gpqa", path, gpqa_seed=seed) for seed in (0, 1)}
    for seed, problems in by_seed.items():
        for p, (a, b) in zip(problems, many):
            shown = p.reference["choices"]
            assert sorted(shown, key=int) == [str(a + b + d) for d in range(4)]
            assert shown["ABCD".index(p.reference["answer"])] == str(a + b)  # the letter names the right option
            original = [str(a + b)] + [str(a + b + d) for d in (1, 2, 3)]
            assert [original[i] for i in p.metadata["order"]] == shown and p.metadata["shuffle_seed"] == seed
            assert MultipleChoiceVerifier().verify(p, apriel(rf"\boxed{{{p.reference['answer']}}}")).success
            assert f"A) {shown[0]}\nB) {shown[1]}" in p.prompt[0]["content"]
    assert [p.reference for p in load("gpqa", path, gpqa_seed=0)] == [p.reference for p in by_seed[0]]
    assert [p.metadata["order"] for p in by_seed[0]] != [p.metadata["order"] for p in by_seed[1]]
    assert len({p.reference["answer"] for p in by_seed[0]}) > 1  # not always the same letter


def test_mmlu_pro_parquet(files):
    problems = load("mmlu_pro", files["mmlu_pro"])
    assert [p.id for p in problems] == ["mmlupro-100", "mmlupro-101", "mmlupro-102"]
    for p, (a, b) in zip(problems, SUMS):
        assert p.reference == {"answer": "B", "choices": [str(a + b + d) for d in (-1, 0, 1, 2, 3)]}
        assert "E) " in p.prompt[0]["content"] and p.domain == "multiple_choice"


def test_livecodebench_window_and_private_tests(files):
    problems = {p.id: p for p in load("livecodebench", files["livecodebench"])}
    assert sorted(problems) == ["lcb-3001", "lcb-abc000_a"]  # the 2023 row is outside the v5 window
    assert len(load("livecodebench", files["livecodebench"], lcb_start="", lcb_end="")) == 3
    stdin = problems["lcb-abc000_a"].reference
    assert stdin["tests"] == [{"input": "1 2\n", "output": "3\n"}, {"input": "4 4\n", "output": "8\n"},
                              {"input": "0 3\n", "output": "3\n"}]
    fn = problems["lcb-3001"].reference
    assert fn["fn_name"] == "listSum"
    assert fn["tests"] == [{"input": [[1, 2, 3]], "output": 6}, {"input": [[]], "output": 0},
                           {"input": [[5, -2]], "output": 3}]
    assert "class Solution" in problems["lcb-3001"].prompt[0]["content"]


def _lcb_file(path: Path, dated: dict[str, str]) -> Path:
    """LiveCodeBench rows (the fixture's first one) under the given question ids and contest dates."""
    base = lcb_rows()[0]
    path.write_text("".join(json.dumps({**base, "question_id": qid, "contest_date": when}) + "\n"
                            for qid, when in dated.items()))
    return path


def test_livecodebench_v5_window_follows_the_official_rule_across_release_files(tmp_path):
    # both sides of each edge of v5's window (--start_date 2024-08-01 --end_date 2025-02-01), as the
    # runner compares: start <= contest_date <= end, as datetimes at 00:00
    test4 = _lcb_file(tmp_path / "test4.jsonl", {"before": "2024-07-31T23:59:59", "at_start": "2024-08-01T00:00:00",
                                                 "v4_inside": "2024-09-15T00:00:00"})
    test5 = _lcb_file(tmp_path / "test5.jsonl", {"v4_inside": "2024-09-15T00:00:00",  # also in the earlier file
                                                 "v5_inside": "2025-01-10T00:00:00", "at_end": "2025-02-01T00:00:00",
                                                 "after_end": "2025-02-01T00:00:01", "later": "2025-03-01T00:00:00"})
    kept = ["lcb-at_start", "lcb-v4_inside", "lcb-v5_inside", "lcb-at_end"]
    assert [p.id for p in load("livecodebench", (test4, test5))] == kept
    assert [p.id for p in load("livecodebench", test5)] == ["lcb-v4_inside", "lcb-v5_inside", "lcb-at_end"]
    spec = BenchmarkSpec.parse(f"lcb_v5:livecodebench:{test4},{test5}")
    assert spec.paths == (test4, test5) and [p.id for p in load_benchmark(spec)] == kept
    assert len(spec.identity()["file_sha256"]) == 2  # a resumed evaluation must read the same files
    out = tmp_path / "lcb_v5.jsonl"  # tools/prepare_data.py: the same window, files and counts
    stats = convert_file("livecodebench", [test4, test5], out, start_date="2024-08-01", end_date="2025-02-01")
    assert stats["written"] == 4 and stats["skipped: duplicate id (in an earlier file)"] == 1
    assert sum(v for k, v in stats.items() if k.startswith("skipped: contest date")) == 3


def test_livecodebench_private_tests_decide_the_score(files, needs_root):
    problems = {p.id: p for p in load("livecodebench", files["livecodebench"])}
    code = VERIFIERS["code"]

    def block(src):
        return apriel(f"```python\n{src}\n```")

    right = "a, b = map(int, input().split())\nprint(a + b)"
    only_public = "print(3)"  # passes the public test, fails the private ones
    assert code.verify(problems["lcb-abc000_a"], block(right)).success
    assert not code.verify(problems["lcb-abc000_a"], block(only_public)).success
    # the starter code names List without importing it: the benchmark's prelude provides it
    listsum = "class Solution:\n    def listSum(self, nums: List[int]) -> int:\n        return sum(nums)"
    assert code.verify(problems["lcb-3001"], block(listsum)).success
    assert not code.verify(problems["lcb-3001"], block(listsum.replace("sum(nums)", "6"))).success


class _Boom:
    def __reduce__(self):
        return (print, ("pickle code ran",))


def test_livecodebench_pickles_naming_code_are_refused(tmp_path):
    rows = lcb_rows()[:1]
    rows[0]["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(_Boom()))).decode()
    path = tmp_path / "evil.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match=r"evil.jsonl: row 1: .*refused to load builtins.print"):
        load("livecodebench", path)


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=GPQA_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return path


@pytest.mark.parametrize("fmt", ["aime", "gpqa", "mmlu_pro", "livecodebench"])
def test_a_malformed_row_is_an_error_naming_file_and_row(fmt, tmp_path):
    if fmt == "aime":
        path = tmp_path / "a.jsonl"
        path.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n" + json.dumps({"problem": "x"}) + "\n")
    elif fmt == "gpqa":
        good = {c: "x" for c in GPQA_COLUMNS} | {"Record ID": "r1"}
        path = _write_csv(tmp_path / "g.csv", [good, {**good, "Record ID": "r2", "Incorrect Answer 2": ""}])
    elif fmt == "mmlu_pro":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [{"question_id": i, "question": "q", "options": ["a", "b", "c"], "answer": ans, "answer_index": 0,
                 "category": "c"} for i, ans in ((1, "A"), (2, "D"))]
        path = tmp_path / "m.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        rows = lcb_rows()[:2]
        rows[1]["private_test_cases"] = "not base64 of anything!"
        path = tmp_path / "l.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"{path.name}: row 2: not in {fmt} format"):
        load(fmt, path)


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown format 'aime24'.*use one of"):
        BenchmarkSpec.parse(f"x:aime24:{tmp_path / 'a.jsonl'}")
    with pytest.raises(ValueError, match="write NAME:FORMAT:PATH"):
        BenchmarkSpec.parse("aime:/data/a.jsonl")
    with pytest.raises(ValueError, match=r"benchmark x: .*missing.jsonl: no such file"):
        load_benchmark(BenchmarkSpec.parse(f"x:aime:{tmp_path / 'missing.jsonl'}"))
    empty = write_lcb(tmp_path / "lcb.jsonl")
    with pytest.raises(ValueError, match="holds no problem.*--lcb-start"):
        load("livecodebench", empty, lcb_start="2030-01-01", lcb_end="")


def test_our_own_problem_files(files, tmp_path):
    from megatron_apriel.data.datasets import write_problems

    converted = load("gpqa", files["gpqa"])
    write_problems(tmp_path / "gpqa.jsonl", converted)  # what tools/prepare_data.py gpqa writes
    assert load("problems", tmp_path / "gpqa.jsonl") == converted


def test_the_actor_refuses_evaluation_only_problems(files, tmp_path):
    from megatron_apriel.config import to_run_config
    from megatron_apriel.data.datasets import training_pools, write_problems
    from tests.unit.config.test_config import compose_run

    write_problems(tmp_path / "gpqa.jsonl", load("gpqa", files["gpqa"]))
    write_problems(tmp_path / "math.jsonl", load("aime", files["aime"]))
    run = to_run_config(compose_run("tiny_local",
                                    [f"actor.data=[{tmp_path / 'math.jsonl'},{tmp_path / 'gpqa.jsonl'}]"]))
    with pytest.raises(ValueError, match=r"holds problems of \['multiple_choice'\], which only evaluation scores"):
        training_pools(run.actor.data, run.actor.sampler.mix)
