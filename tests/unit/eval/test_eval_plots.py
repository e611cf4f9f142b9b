"""apriel-eval's plots: labelled axes, one point per model and benchmark, the frontier through the
non-dominated points only; training curves from a TensorBoard log written by our logger."""


import pytest

from megatron_apriel.entrypoints.eval import main
from megatron_apriel.eval.plots import FRONTIER_GID, budget_figure, frontier_figure, training_curves_figure
from megatron_apriel.eval.report import REPORT_KIND, write_report
from megatron_apriel.eval.results import ResultsFile, SampleRecord

# (mean output tokens, pass@1) per model and benchmark, chosen by hand:
POINTS = {
    "aime": {"base": (9000, 0.50), "rl": (6000, 0.55), "short": (3000, 0.30), "bad": (6000, 0.45)},
    "gpqa": {"base": (5000, 0.60), "rl": (5000, 0.60), "short": (2000, 0.40), "bad": (6000, 0.70)},
}
# the non-dominated points of each benchmark, by tokens: worked out by hand from POINTS
# (aime: "base" loses to "rl", and so does "bad" at equal tokens; gpqa: "base" and "rl" coincide, neither
# dominates the other)
FRONTIER = {"aime": [(3000, 30.0), (6000, 55.0)], "gpqa": [(2000, 40.0), (5000, 60.0), (5000, 60.0), (6000, 70.0)]}


def report(label: str) -> dict:
    benchmarks = {}
    for name, models in POINTS.items():
        tokens, acc = models[label]
        benchmarks[name] = {"pass@1": acc, "mean_output_tokens": tokens, "samples_per_problem": 2,
                            "pass@1_at_budget": {"1000": acc / 3, "4000": acc / 2, "16000": acc}}
    return {"kind": REPORT_KIND, "label": label, "benchmarks": benchmarks}


def entries():
    return [(label, report(label)) for label in ("base", "rl", "short", "bad")]


def test_frontier_figure():
    fig = frontier_figure(entries())
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["aime", "gpqa"]
    for ax in axes:
        assert ax.get_xlabel() == "mean output tokens" and ax.get_ylabel() == "pass@1 (%)"
        offsets = [tuple(c.get_offsets()[0]) for c in ax.collections]
        assert all(len(c.get_offsets()) == 1 for c in ax.collections)  # one point per model
        models = POINTS[ax.get_title()]
        assert offsets == [(t, 100 * a) for t, a in models.values()]
        assert [t.get_text() for t in ax.texts] == list(models)  # each point labelled
        (front,) = [line for line in ax.get_lines() if line.get_gid() == FRONTIER_GID]
        assert [(x, round(y, 9)) for x, y in zip(front.get_xdata(), front.get_ydata())] == FRONTIER[ax.get_title()]


def test_budget_figure():
    fig = budget_figure(entries())
    for ax in fig.axes:
        assert ax.get_xlabel() == "token budget" and ax.get_ylabel() == "pass@1 (%)"
        assert len(ax.get_lines()) == 4
        for line, label in zip(ax.get_lines(), POINTS[ax.get_title()]):
            acc = POINTS[ax.get_title()][label][1]
            assert list(line.get_xdata()) == [1000, 4000, 16000]
            assert list(line.get_ydata()) == pytest.approx([100 * acc / 3, 100 * acc / 2, 100 * acc])


def _write_eval(out, label):
    out.mkdir(parents=True)
    write_report(out, {**report(label), "checkpoint": "-", "timing": {},
                       "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 9, "seed": 0}}
                 | {"benchmarks": {n: {**b, "problems": 1, "ci95": [None, None], "pass@k": {}, "truncated_share": 0,
                                       "median_output_tokens": 1} for n, b in report(label)["benchmarks"].items()}})
    for name in POINTS:
        results = ResultsFile(out / "samples" / f"{name}.jsonl")
        for i in range(2):
            results.append(SampleRecord(benchmark=name, problem_id="p", sample=i, seed=i, prompt_tokens=1,
                                        completion_ids=[1] * (i + 1), finish_reason="stop", text="t",
                                        outcome="wrong", success=False, score=0.0))


def test_plot_command_writes_the_pngs(tmp_path, capsys):
    for label in ("base", "rl"):
        _write_eval(tmp_path / label, label)
    assert main(["plot", str(tmp_path / "base"), str(tmp_path / "rl"), "--out", str(tmp_path / "plots")]) == 0
    for png in ("frontier", "lengths", "budget"):
        assert (tmp_path / "plots" / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path / "base"), str(tmp_path / "rl"), "--bench", "gpqa",
                 "--out", str(tmp_path / "g")]) == 0
    from PIL import Image

    one, both = (Image.open(tmp_path / d / "frontier.png").size for d in ("g", "plots"))
    assert one[0] < both[0] * 0.6 and one[1] == both[1]  # one panel instead of two
    with pytest.raises(SystemExit) as exit_:
        main(["plot", str(tmp_path / "base"), "--bench", "mmlu", "--out", str(tmp_path / "plots")])
    assert exit_.value.code == 2 and "benchmarks ['mmlu'] are in none of the results" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["plot", str(tmp_path / "base"), str(tmp_path / "nowhere"), "--out", str(tmp_path / "plots")])
    assert exit_.value.code == 2 \
        and "nowhere: no such file; give an apriel-eval output directory" in capsys.readouterr().err


def test_training_curves_from_the_run_log(tmp_path):
    from megatron_apriel.metrics import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path / "run" / "tensorboard")
    for step in range(1, 4):
        logger.log({"domain/math/reward": 0.1 * step, "domain/code/reward": 0.2, "domain/math/length": 100.0 - step,
                    "domain/code/length": 50.0, "mix/math/realised": 0.6, "mix/math/target": 0.5,
                    "mix/code/realised": 0.4, "mix/code/target": 0.5, "train/loss": 1.0}, step)
        logger.log({"mix/math/trained": 0.7, "mix/code/trained": 0.3} if step > 1 else {}, step)
    logger.close()
    fig = training_curves_figure(tmp_path / "run")
    reward, length, mix = fig.axes
    assert [ax.get_ylabel() for ax in fig.axes] == ["reward", "response length (tokens)", "domain share"]
    assert all(ax.get_xlabel() == "step" for ax in fig.axes)
    by_label = {line.get_label(): line for line in reward.get_lines()}
    assert sorted(by_label) == ["code", "math"]
    assert list(by_label["math"].get_xdata()) == [1, 2, 3]
    assert list(by_label["math"].get_ydata()) == pytest.approx([0.1, 0.2, 0.3])
    assert len(mix.get_lines()) == 6  # realised, trained and target per domain
    assert [line.get_linestyle() for line in mix.get_lines()][:3] == ["-", "--", ":"]
    assert list(mix.get_lines()[1].get_ydata()) == pytest.approx([0.3, 0.3])  # code (sorted first), from step 2
    with pytest.raises(ValueError, match="no TensorBoard event files"):
        training_curves_figure(tmp_path / "elsewhere")
    assert main(["curves", str(tmp_path / "run"), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "training_curves.png").read_bytes()[:4] == b"\x89PNG"
