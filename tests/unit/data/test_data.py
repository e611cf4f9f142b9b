import json
import random
from pathlib import Path

import pytest

from megatron_apriel.data import ProblemPools, load_problems, write_problems
from megatron_apriel.data.converters import SkipRow, convert_apps, convert_if_multi, convert_orz, convert_taco
from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers import Outcome, verify
from tests.unit.conftest import apriel
from tools.prepare_data import convert_file

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "data"
DOMAINS = ["math", "code", "logic", "ifeval", "function_calling"]


@pytest.mark.parametrize("domain", DOMAINS)
def test_example_files_load(domain):
    problems = load_problems(EXAMPLES / f"{domain}.jsonl", domain=domain)
    assert 15 <= len(problems) <= 25


def test_example_gold_answers_verify():
    for p in load_problems(EXAMPLES / "math.jsonl"):
        assert verify("math", p, apriel(rf"\boxed{{{p.reference}}}")).success, p.id
    for p in load_problems(EXAMPLES / "logic.jsonl"):
        gold = p.reference["entry"]["answer"] if p.reference["source"] == "reasoning_gym" else p.reference["answer"]
        assert verify("logic", p, apriel(rf"\boxed{{{gold}}}")).success, p.id
    fc = load_problems(EXAMPLES / "function_calling.jsonl") + load_problems(EXAMPLES / "function_calling_bfcl.jsonl")
    for p in fc:
        calls = [{"name": name, "arguments": {k: next(v for v in opts if v != "") for k, opts in args.items()
                                              if any(v != "" for v in opts)}}
                 for g in p.reference["ground_truth"] for name, args in g.items()]
        assert verify("function_calling", p, apriel(f"<tool_calls>{json.dumps(calls)}</tool_calls>")).success, p.id


def test_bfcl_example_is_real_bfcl_with_its_licence():
    problems = load_problems(EXAMPLES / "function_calling_bfcl.jsonl", domain="function_calling")
    assert 15 <= len(problems) <= 25 and {p.metadata["source"] for p in problems} == {"bfcl_v4"}
    assert len({p.metadata["category"] for p in problems}) >= 6
    notice = (EXAMPLES / "function_calling_bfcl.LICENSE").read_text()
    assert "Apache License" in notice and "bfcl-eval 2026.3.23" in notice


# A correct and a plausibly wrong solution for each shipped code example (the examples carry tests
# but no reference solution): the tests must accept the first and reject the second.
CODE_SOLUTIONS = {
    "code-00": ("a, b = map(int, input().split())\nprint(a + b)", "a, b = map(int, input().split())\nprint(a - b)"),
    "code-01": ("input()\nprint(max(map(int, input().split())))", "input()\nprint(min(map(int, input().split())))"),
    "code-02": ("print(input()[::-1])", "print(input())"),
    "code-03": ("import math\nprint(math.factorial(int(input())))",
                "n = int(input())\nr = 1\nfor i in range(1, n):\n    r *= i\nprint(r)"),
    "code-04": ("n = int(input())\nprint('YES' if n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1)) else 'NO')",
                "n = int(input())\nprint('YES' if n % 2 else 'NO')"),
    "code-05": ("print(len(input().split()))", "print(len(input().split()) - 1)"),
    "code-06": ("n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)",
                "n = int(input())\na, b = 0, 1\nfor _ in range(n - 1):\n    a, b = b, a + b\nprint(a)"),
    "code-07": ("print(*sorted(map(int, input().split())))", "print(*sorted(input().split(), reverse=True))"),
    "code-08": ("print(sum(c in 'aeiou' for c in input()))", "print(sum(c in 'aeiouy' for c in input()))"),
    "code-09": ("import math\na, b = map(int, input().split())\nprint(math.gcd(a, b))",
                "a, b = map(int, input().split())\nprint(min(a, b))"),
    "code-fn-00": ("def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b"),
    "code-fn-01": ("def is_palindrome(s):\n    return s == s[::-1]", "def is_palindrome(s):\n    return True"),
    "code-fn-02": ("def two_sum(nums, target):\n    seen = {}\n    for i, x in enumerate(nums):\n"
                   "        if target - x in seen:\n            return [seen[target - x], i]\n        seen[x] = i",
                   "def two_sum(nums, target):\n    return [0, 1]"),
    "code-fn-03": ("from collections import Counter\ndef count_chars(s):\n    return dict(Counter(s))",
                   "def count_chars(s):\n    return {c: 1 for c in s}"),
    "code-fn-04": ("def flatten(xs):\n    return [y for x in xs for y in x]", "def flatten(xs):\n    return xs"),
    "code-fn-05": ("def mean(xs):\n    return sum(xs) / len(xs)", "def mean(xs):\n    return sum(xs) // len(xs)"),
    "code-fn-06": ("def rotate(xs, k):\n    k %= len(xs)\n    return xs[-k:] + xs[:-k]",
                   "def rotate(xs, k):\n    return xs[k:] + xs[:k]"),
    "code-fn-07": ("def missing_number(nums):\n    n = len(nums)\n    return n * (n + 1) // 2 - sum(nums)",
                   "def missing_number(nums):\n    return len(nums)"),
    "code-fn-08": ("class Solution:\n    def capitalize_words(self, s):\n"
                   "        return ' '.join(w[:1].upper() + w[1:] for w in s.split(' '))",
                   "def capitalize_words(s):\n    return s.capitalize()"),
    "code-fn-09": ("def binary(n):\n    return bin(n)[2:]", "def binary(n):\n    return bin(n)"),
}


def test_every_code_example_has_its_solutions_here():
    assert sorted(p.id for p in load_problems(EXAMPLES / "code.jsonl")) == sorted(CODE_SOLUTIONS)


@pytest.mark.parametrize("pid", sorted(CODE_SOLUTIONS))
def test_example_code_tests_accept_a_solution_and_reject_a_wrong_one(needs_root, pid):
    problem = next(p for p in load_problems(EXAMPLES / "code.jsonl") if p.id == pid)
    right, wrong = CODE_SOLUTIONS[pid]
    r = verify("code", problem, apriel(f"```python\n{right}\n```"))
    assert r.score == 1.0, r.detail
    r = verify("code", problem, apriel(f"```python\n{wrong}\n```"))
    assert r.score < 1.0 and r.outcome is Outcome.WRONG, r.detail


def test_round_trip_and_pools(tmp_path):
    problems = [Problem(f"p{i}", "math", [{"role": "user", "content": f"q{i}"}], str(i)) for i in range(5)]
    problems.append(Problem("c", "code", [{"role": "user", "content": "x"}], {"tests": [{"input": [1], "output": 2}]}))
    path = tmp_path / "mixed.jsonl"
    write_problems(path, problems)
    assert load_problems(path) == problems
    pools = ProblemPools.from_files([path])
    assert pools.domains == ("math", "code") and pools.size("math") == 5
    rng = random.Random(0)
    assert {pools.draw("math", rng).id for _ in range(200)} == {f"p{i}" for i in range(5)}
    with pytest.raises(ValueError, match="no problems for domain 'logic'"):
        pools.draw("logic", rng)


def test_parquet(tmp_path):
    import datasets

    from megatron_apriel.data import problem_to_row
    rows = [problem_to_row(Problem("a", "math", [{"role": "user", "content": "1+1"}], "2"))]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "m.parquet"))
    assert load_problems(tmp_path / "m.parquet")[0].reference == "2"


def _good_line(i):
    return json.dumps({"id": f"m{i}", "domain": "math", "prompt": [{"role": "user", "content": "q"}],
                       "reference": json.dumps("1"), "metadata": "{}"})


def test_malformed_rows_name_file_and_row(tmp_path):
    bad_json = tmp_path / "bad_json.jsonl"
    bad_json.write_text("\n".join([_good_line(0), _good_line(1), '{"id": "m2", "domain": ']) + "\n")
    with pytest.raises(ValueError, match=r"bad_json.jsonl:3"):
        load_problems(bad_json)
    bad_domain = tmp_path / "bad_domain.jsonl"
    bad_domain.write_text("\n".join([_good_line(0), _good_line(1).replace('"math"', '"poetry"')]) + "\n")
    with pytest.raises(ValueError, match=r"bad_domain.jsonl: row 2: .*poetry"):
        load_problems(bad_domain)
    bad_ref = tmp_path / "bad_ref.jsonl"
    bad_ref.write_text(_good_line(0).replace('"\\"1\\""', '"{not json"') + "\n")
    with pytest.raises(ValueError, match=r"bad_ref.jsonl: row 1: .*JSON text"):
        load_problems(bad_ref)


# Tiny inputs in each source format, written from the formats' documented field names.

def test_convert_orz(tmp_path):
    src = tmp_path / "orz.json"
    src.write_text(json.dumps([
        [{"from": "human", "value": "What is 1/2 + 1/4?"},
         {"from": "assistant", "ground_truth": {"value": "\\frac{3}{4}"}}],
        [{"from": "human", "value": "2+2?"}, {"from": "assistant", "ground_truth": {"value": ""}}]]))
    stats = convert_file("orz", src, tmp_path / "out.jsonl")
    assert stats["written"] == 1 and stats["skipped: empty answer"] == 1
    (p,) = load_problems(tmp_path / "out.jsonl")
    assert p.domain == "math" and verify("math", p, apriel(r"\boxed{0.75}")).success
    with pytest.raises(ValueError):
        convert_orz({"question": "x"}, 0)


def test_convert_taco_and_apps():
    stdin_row = {"question": "Add two numbers.", "starter_code": "", "difficulty": "EASY",
                 "input_output": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})}
    p = convert_taco(stdin_row, 0)
    assert p.reference == {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "3 4\n", "output": "7\n"}]}
    fn_row = {"problem_id": 17, "question": "Return a+b.", "starter_code": "def add(a, b):",
              "difficulty": "introductory",
              "input_output": json.dumps({"fn_name": "add", "inputs": [[1, 2]] * 7, "outputs": [[3]] * 7})}
    p = convert_apps(fn_row, 0)
    assert p.id == "apps-17" and p.reference["fn_name"] == "add" and len(p.reference["tests"]) == 5
    assert p.reference["tests"][0] == {"input": [1, 2], "output": 3}
    with pytest.raises(SkipRow, match="VERY_HARD"):
        convert_taco({**stdin_row, "difficulty": "VERY_HARD"}, 0)


def test_convert_i3_logic(tmp_path):
    rows = [{"question": "Is it raining? Answer in \\boxed{}.", "avg@16_qwen3_4b_instruct_2507": 0.5,
             "info": json.dumps({"task": "web_of_lies",
                                 "game_data_str": json.dumps({"answer": "No", "metadata": {}})})},
            {"question": "arc", "info": json.dumps({"task": "arc_agi", "game_data_str": "{}"})}]
    src = tmp_path / "i3.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    stats = convert_file("i3_logic", src, tmp_path / "out.jsonl")
    assert stats["written"] == 1
    (p,) = load_problems(tmp_path / "out.jsonl")
    assert verify("logic", p, apriel(r"\boxed{no}")).success


def test_convert_if_multi():
    row = {"key": "k1", "messages": [{"role": "user", "content": "Write about dogs in lowercase without commas."}],
           "ground_truth": "[{'instruction_id': ['change_case:english_lowercase', 'punctuation:no_comma'], "
                           "'kwargs': [None, {'unused': None}]}]",
           "constraint_type": "multi", "dataset": "ifeval"}
    p = convert_if_multi(row, 0)
    assert p.reference == {"instruction_id_list": ["change_case:english_lowercase", "punctuation:no_comma"],
                           "kwargs": [{}, {}]}
    with pytest.raises(SkipRow, match="unsupported"):
        convert_if_multi({**row, "ground_truth": json.dumps([{"instruction_id": ["count:word_count_range"],
                                                              "kwargs": [{}]}])}, 1)


def test_convert_bfcl(tmp_path):
    fn = {"name": "calc_area", "description": "Area of a rectangle.", "parameters": {
        "type": "dict", "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}}, "required": ["w", "h"]}}
    q = tmp_path / "BFCL_v4_simple_python.json"
    q.write_text(json.dumps({"id": "simple_python_0", "question": [[{"role": "user", "content": "Area of 3 by 4?"}]],
                             "function": [fn]}) + "\n"
                 + json.dumps({"id": "simple_python_1", "question": [[{"role": "user", "content": "?"}]],
                               "function": [fn]}))
    a = tmp_path / "answers.json"
    a.write_text(json.dumps({"id": "simple_python_0", "ground_truth": [{"calc_area": {"w": [3], "h": [4]}}]}))
    stats = convert_file("bfcl", q, tmp_path / "out.jsonl", answers=a)
    assert stats["written"] == 1 and sum(v for k, v in stats.items() if k.startswith("skipped")) == 1
    (p,) = load_problems(tmp_path / "out.jsonl")
    good = apriel('<tool_calls>[{"name": "calc_area", "arguments": {"w": 3, "h": 4}}]</tool_calls>')
    assert verify("function_calling", p, good).success and p.metadata["category"] == "simple_python"


def test_converter_reports_bad_source_row(tmp_path):
    src = tmp_path / "taco.jsonl"
    src.write_text(json.dumps({"question": "q", "difficulty": "EASY", "input_output": "{broken"}) + "\n")
    with pytest.raises(ValueError, match=r"taco.jsonl: row 1: not in taco format"):
        convert_file("taco", src, tmp_path / "out.jsonl")
