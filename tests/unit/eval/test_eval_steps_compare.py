"""apriel-eval steps --compare on two fixed evaluations, base and trained: the printed comparison
and the figure's bars equal hand counts, offline (steps only) and with the fake judge's labels."""

import json

import matplotlib.pyplot as plt
import pytest

from megatron_apriel.entrypoints.eval import main
from megatron_apriel.eval.steps.compare import NO_LABELS, compare_figure, comparison_rows
from megatron_apriel.eval.steps.prompts import LABELS
from megatron_apriel.testing.fake_judge import FakeJudge
from tests.steps_fixtures import write_evaluation

FINAL = "[BEGIN FINAL RESPONSE]{}[END FINAL RESPONSE]"  # 5 whitespace words
BASE = [  # steps (words): labels by the fake judge's keywords
    ("We are given x.\n\nCompute 2 + 2 = 4.\n\nAgain 4.\n\n" + FINAL.format(4), True),
    # 4 (4): problem_setup, 6: forward_reasoning, 2: other, 5: final_answer
    ("Compute 1 + 1 = 2.\n\nAs I said, 2.\n\nAgain 2.\n\n" + FINAL.format(2), True),
    # 6: forward_reasoning, 4: other, 2: other, 5: final_answer
    ("Compute 9.\n\nWrong.", False),  # not correct: left out
]
TRAINED = [
    ("Check: 2 + 2 = 4.\n\n" + FINAL.format(4), True),  # 6: verification, 5: final_answer
    ("First, add.\n\n1 + 1 = 2.\n\nWait, check.\n\n" + FINAL.format(2), True),
    # 2: subgoal_setting, 5: forward_reasoning, 2: backtracking, 5: final_answer
]


@pytest.fixture
def evals(tmp_path):
    return (write_evaluation(tmp_path / "base", "base", {"aime": BASE}),
            write_evaluation(tmp_path / "rl", "rl", {"aime": TRAINED}))


def reports(evals, name: str) -> tuple[dict, dict]:
    return tuple(json.loads((e / "steps" / name / "report.json").read_text()) for e in evals)


def heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


def test_offline_comparison_and_figure(evals, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["steps", "--compare", *map(str, evals), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    a, b = reports(evals, "offline")
    assert a["method"]["segmenter"] == "offline-rules-v1" and "whitespace-separated words" in a["tokens"]
    rows = {r[0]: r[1:] for r in comparison_rows(a, b, "aime")}
    assert rows["steps per response (mean)"] == ["4.0", "3.0", "-25%"]  # 4, 4 steps vs 2, 4
    assert rows["steps per response (median)"] == ["4.0", "3.0", "-25%"]
    assert rows["tokens per step (mean)"] == ["4.2", "4.2", "-2%"]  # 34 / 8 = 4.25 vs 25 / 6 = 4.17
    assert rows["tokens per step (median)"] == ["4.5", "5.0", "+11%"]  # of 2,2,4,4,5,5,6,6 vs 2,2,5,5,5,6
    assert "problem_setup %" not in rows and rows["non-productive (other) %"] == ["-", "-", "-"]
    assert "tokens per step (median)" in printed and "+11%" in printed
    assert (out / "steps_aime.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = compare_figure(a, b, "aime", ("base", "rl"))
    steps_ax, tokens_ax, labels_ax = fig.axes
    assert heights(steps_ax) == [4, 3] and heights(tokens_ax) == pytest.approx([34 / 8, 25 / 6])
    assert [t.get_text() for t in labels_ax.texts] == [NO_LABELS] and not labels_ax.patches
    plt.close(fig)


def test_judged_comparison_and_figure(evals, tmp_path, capsys):
    with FakeJudge() as judge:
        assert main(["steps", "--compare", *map(str, evals), "--out", str(tmp_path / "cmp"), "--no-progress",
                     "--judge-url", judge.url, "--judge-model", "fake-judge"]) == 0
    printed = capsys.readouterr().out
    a, b = reports(evals, "judge-fake-judge")
    rows = {r[0]: r[1:] for r in comparison_rows(a, b, "aime")}
    assert rows["non-productive (other) %"] == ["37.5", "0.0", "-37.5 pts"]  # 3 of 8 steps vs 0 of 6
    assert rows["verification+backtracking+subgoal+backward %"] == ["0.0", "50.0", "+50.0 pts"]  # 0/8 vs 3/6
    assert rows["failed responses %"] == ["0.0", "0.0", "+0.0 pts"]
    assert "-37.5 pts" in printed
    fig = compare_figure(a, b, "aime", ("base", "rl"))
    label_bars = heights(fig.axes[2])
    base = {"problem_setup": 1, "forward_reasoning": 2, "other": 3, "final_answer": 2}
    trained = {"verification": 1, "subgoal_setting": 1, "forward_reasoning": 1, "backtracking": 1, "final_answer": 2}
    assert label_bars[:8] == pytest.approx([100 * base.get(k, 0) / 8 for k in LABELS])
    assert label_bars[8:] == pytest.approx([100 * trained.get(k, 0) / 6 for k in LABELS])
    assert [t.get_text() for t in fig.axes[2].get_legend().get_texts()] == ["base", "rl"]
    plt.close(fig)
