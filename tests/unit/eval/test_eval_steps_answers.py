"""apriel-eval steps against fake judges that answer as chat models do (megatron_apriel/testing/
fake_judge.py), in both modes, through the command line: whitespace stripped, a preamble and a
fenced block, a digit changed, boundaries only, an ambiguous boundary; each accepted, or refused
with its reason, and label shares equal to hand counts; then the output tokens of the two modes
on the same windows (printed: `pytest -s`). Tokens per step are whitespace words (no manifest)."""

import json
from pathlib import Path

import pytest

from megatron_apriel.entrypoints.eval import main
from megatron_apriel.testing.fake_judge import FakeJudge
from tests.steps_fixtures import write_evaluation

FINAL = "[BEGIN FINAL RESPONSE]5[END FINAL RESPONSE]"


def trace(case: str) -> str:
    """Four steps, by the fake judge's keywords: problem_setup (10 words), forward_reasoning (6),
    verification (6), final_answer (5). "So" begins step 1 and recurs in step 0."""
    return f"[case:{case}] We are given 2 + 3. So we add.\n\nSo 2 + 3 = 5.\n\nCheck: 5 - 3 = 2.\n\n{FINAL}"


CASES = ["correct", "strip", "preamble", "digit", "ambiguous"]
LABELS = ["problem_setup", "forward_reasoning", "verification", "final_answer"]


def run(ev: Path, judge: FakeJudge, *extra: str) -> dict:
    argv = ["steps", str(ev), "--no-progress", "--judge-url", judge.url, "--judge-model", "fake-judge", *extra]
    assert main(argv) == 0
    mode = "copy" if "copy" in extra else "boundaries"
    report = json.loads((ev / "steps" / "judge-fake-judge" / "report.json").read_text())
    assert report["method"]["judge"]["mode"] == mode
    return report


def check_accepted(report: dict, accepted: list[str]) -> dict:
    """The rows by case; every accepted one is the trace's four steps with their hand labels."""
    b = report["benchmarks"]["aime"]
    assert (b["responses"], b["accepted"]) == (len(CASES), len(accepted))
    shares = {k: v["share"] for k, v in b["labels"].items()}
    assert shares == pytest.approx({k: 0.25 if k in LABELS else 0.0 for k in shares})  # 1 of 4 steps, each
    rows = {CASES[int(r["problem_id"][-2:])]: r for r in report["traces"]}
    for case in accepted:
        assert rows[case]["labels"] == LABELS and rows[case]["tokens"] == [10, 6, 6, 5], case  # the trace's own text
    return rows


def test_chat_model_answers_in_copy_mode(tmp_path, capsys):
    ev = write_evaluation(tmp_path / "ev", "base", {"aime": [(trace(c), True) for c in CASES]})
    with FakeJudge() as judge:
        report = run(ev, judge, "--judge-mode", "copy")
        attempts = {c: sum(f"[case:{c}]" in w for w, _ in judge.requests) for c in CASES}
    # whitespace stripped and prose around a fence are forgiven; copying needs no starts, so none is ambiguous
    rows = check_accepted(report, ["correct", "strip", "preamble", "ambiguous"])
    digit = trace("digit").index("2")
    assert rows["digit"]["failure"] == "not_verbatim"
    assert f"at trace character {digit}: trace '2 + 3. So we add." in rows["digit"]["detail"]
    assert rows["digit"]["detail"].split("step 0 ")[1].startswith("'3 + 3.")
    assert attempts == {"correct": 1, "strip": 1, "preamble": 1, "digit": 3, "ambiguous": 1}
    assert "copy mode, prompts v1" in capsys.readouterr().out


def test_chat_model_answers_in_boundaries_mode(tmp_path):
    ev = write_evaluation(tmp_path / "ev", "base", {"aime": [(trace(c), True) for c in CASES]})
    with FakeJudge() as judge:
        report = run(ev, judge)
    rows = check_accepted(report, ["correct", "strip", "preamble"])
    assert rows["digit"]["failure"] == "bad_boundary"
    assert "step 0's start '[case:digit] We are given 3 +' is not how the trace begins" in rows["digit"]["detail"]
    assert rows["ambiguous"]["failure"] == "bad_boundary"
    says = "step 1's start 'So' is ambiguous: it occurs 2 times"
    assert says in rows["ambiguous"]["detail"]
    assert sum(says in r for r in judge.retries) == 2  # the reason went back to the judge on each retry
    assert report["benchmarks"]["aime"]["failure_reasons"] == {"bad_boundary": 2}


PARAGRAPHS = [
    "The problem asks for the number of positive integers n below 1000 such that n squared ends in the digits 76, "
    "so we need every residue of n modulo 1000 whose square is congruent to 76 modulo 100.",
    "First, work modulo 4 and modulo 25 separately. Modulo 4 the square must be 0, so n is even; modulo 25 the "
    "square must be 1, so n is congruent to 1 or 24 modulo 25, because 25 is a prime power.",
    "Combining with the Chinese remainder theorem, n modulo 50 is one of 24 or 26 once parity is imposed, and each "
    "class contributes its lifts below 1000: there are 20 numbers in each of the two classes.",
    "Let me check with an example: 24 squared is 576 and 26 squared is 676, and 74 squared is 5476, which all end "
    "in 76 as required, while 25 squared is 625, which does not, as expected for an odd number.",
    "Wait, 74 is congruent to 24 modulo 50, so it is already counted; the count of 40 stands, and no class was "
    "double counted because 24 and 26 differ modulo 50.",
    "[BEGIN FINAL RESPONSE]There are \\boxed{40} such integers below 1000.[END FINAL RESPONSE]",
]


def test_boundaries_cost_a_fraction_of_the_output_tokens_of_copying(tmp_path):
    texts = ["\n\n".join(PARAGRAPHS[i:] + PARAGRAPHS[:i]) for i in range(3)]  # 3 windows of ~1,000 characters
    ev = write_evaluation(tmp_path / "ev", "base", {"aime": [(t, True) for t in texts]})
    per_window, steps = {}, {}
    for mode in ("copy", "boundaries"):
        with FakeJudge() as judge:
            report = run(ev, judge, "--judge-mode", mode)
        throughput = report["method"]["judge"]["throughput"]
        assert throughput["windows_judged"] == 3 and report["benchmarks"]["aime"]["accepted"] == 3
        per_window[mode] = throughput["completion_tokens_per_window"]
        chars = sum(map(len, texts)) / 3
        print(f"\n{mode}: {per_window[mode]:.0f} completion tokens per window of {chars:.0f} characters, "
              f"{throughput['completion_tokens_per_char']:.3f} per trace character")
        steps[mode] = [(r["tokens"], r["labels"]) for r in report["traces"]]
    assert steps["copy"] == steps["boundaries"]  # the same steps and labels
    print(f"boundaries / copy: {per_window['boundaries'] / per_window['copy']:.2f}")
    assert per_window["boundaries"] < per_window["copy"] / 3
