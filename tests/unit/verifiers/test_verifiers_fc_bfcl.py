"""The function-calling verifier and the BFCL converter, held to BFCL's own checker on real BFCL v4.

Needs `pip install --no-deps bfcl-eval==2026.3.23` (tools/setup_cpu_env.sh); skipped without it,
except under CI=true where it must run. The agreement table: `python -m tests.unit.verifiers.bfcl_agreement`.
"""

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from megatron_apriel.data import load_problems
from megatron_apriel.verifiers import verify
from tests.unit.conftest import apriel
from tests.unit.verifiers import bfcl_agreement as bfcl
from tools.prepare_data import convert_file

if bfcl.bfcl_data_dir() is None:
    message = f"bfcl-eval is not installed: pip install --no-deps bfcl-eval=={bfcl.BFCL_VERSION}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the BFCL tests but {message} (tools/setup_cpu_env.sh does it)", pytrace=False)
    pytest.skip(message, allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "data"
# Items of BFCL v4 that no call passes, by BFCL's checker as by ours (`unpassable_reason`).
UNPASSABLE = {"live_multiple_862-181-3", "live_multiple_964-207-0", "live_simple_106-63-0", "live_simple_112-68-0"}
# The mutation kinds of the issue, each of which must be met often enough to matter.
REQUIRED_KINDS = ("wrong_name", "missing_required", "missing_gold_mandatory", "off_list", "extra_param",
                  "dropped_call", "gold_reordered", "case_space", "int_for_float", "null_listed",
                  "null_unlisted", "null_for_mandatory")
# Single-turn AST categories of the recipe (RECIPE.md section 6).
RECIPE_CATEGORIES = (*bfcl.CATEGORIES, "simple_java", "simple_javascript", "live_parallel", "live_parallel_multiple")


@pytest.fixture(scope="module")
def report():
    return bfcl.compare()


def test_every_category_and_mutation_kind_is_exercised(report):
    assert all(report.problems[c] >= 100 for c in bfcl.CATEGORIES), report.problems
    per_kind = Counter()
    for (_, kind), n in report.total.items():
        per_kind[kind] += n
    assert {k: per_kind[k] for k in REQUIRED_KINDS if per_kind[k] < 100} == {}
    assert all(per_kind[k] >= 2 for k in per_kind), per_kind


def test_verdicts_agree_with_bfcl(report):
    print(report.table())
    assert report.undocumented == [], f"{len(report.undocumented)} disagreements, e.g. {report.undocumented[:3]}"
    agree, total = report.rate()
    assert agree / total >= 0.999
    gold_agree, gold_total = report.rate(gold=True)
    assert gold_agree + sum(kind in bfcl.GOLD_KINDS for _, kind in report.greedy) == gold_total


def test_documented_differences(report):
    # Our one-to-one matching accepts an order of parallel_178's calls that BFCL's greedy one misses.
    assert ("parallel_178", "gold_reordered") in report.greedy
    assert {kind for _, kind in report.documented} <= set(bfcl.DOCUMENTED_KINDS)
    assert set(report.unpassable) == UNPASSABLE
    assert report.unpassable_accepted_by_bfcl == []


def _as_completion(calls):
    return apriel("<tool_calls>" + json.dumps([{"name": n, "arguments": a} for n, a in calls]) + "</tool_calls>")


@pytest.mark.parametrize("category", RECIPE_CATEGORIES)
def test_prepare_data_converts_the_shipped_files(tmp_path, category):
    data = bfcl.bfcl_data_dir()
    src, answers = data / f"BFCL_v4_{category}.json", data / "possible_answer" / f"BFCL_v4_{category}.json"
    stats = convert_file("bfcl", src, tmp_path / "out.jsonl", answers=answers)
    rows = {row["id"]: gold for row, gold in bfcl.load_category(category)}
    skipped = {key for key in stats if key.startswith("skipped")}
    broken = {i for i in rows if any(f": {i}: " in key for key in skipped)}
    assert broken == UNPASSABLE & set(rows) and stats["written"] + len(broken) == len(rows), stats
    problems = load_problems(tmp_path / "out.jsonl", domain="function_calling")
    assert {p.id for p in problems} == {f"bfcl-{i}" for i in rows if i not in broken}
    for p in problems:
        assert p.metadata["category"] == category and p.reference["ground_truth"] == rows[p.id.removeprefix("bfcl-")]
        row = {"id": p.id, "function": p.reference["functions"]}
        gold = next(calls for kind, calls in bfcl.predictions(row, p.reference["ground_truth"]) if kind == "gold_first")
        assert verify("function_calling", p, _as_completion(gold)).success, p.id


def test_example_extract_is_unchanged_bfcl_data():
    examples = load_problems(EXAMPLES / "function_calling_bfcl.jsonl", domain="function_calling")
    shipped = {row["id"]: (row, gold) for c in {p.metadata["category"] for p in examples}
               for row, gold in bfcl.load_category(c)}
    for p in examples:
        row, gold = shipped[p.id.removeprefix("bfcl-")]
        assert p.reference == {"ground_truth": gold, "functions": row["function"]}, p.id
        assert [m["content"] for m in p.prompt] == [m["content"] for m in row["question"][0]], p.id
