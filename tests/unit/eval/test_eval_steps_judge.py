"""apriel-eval steps against a fake judge (megatron_apriel/testing/fake_judge.py), through the
command line, in copy mode (prompts v1; test_eval_steps_answers.py has the default boundaries
mode): every way a judge can answer ends as the rules say (accepted; retried; failed with its
reason), the run never crashes, a rerun asks nothing, and a SIGKILL leaves a usable cache.
Expected numbers are hand counts (whitespace words: the evaluations have no manifest)."""

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from megatron_apriel.entrypoints.eval import main
from megatron_apriel.eval.steps.cache import Verdict
from megatron_apriel.eval.steps.prompts import PROMPTS_FILE
from megatron_apriel.testing.fake_judge import FakeJudge
from tests.steps_fixtures import write_evaluation
from tests.unit.conftest import launcher_env

REPO = Path(__file__).resolve().parents[3]
FINAL = "[BEGIN FINAL RESPONSE]3[END FINAL RESPONSE]"
CASES = [
    (f"We are given 1 + 2.\n\nSo 1 + 2 = 3.\n\n{FINAL}", True),  # A: 79 chars, two windows of 60: 3 steps
    ("Check it again.\n\nAgain 3.", True),  # B: verification, other
    ("[case:malformed] 1.", True),  # C: malformed JSON three times
    ("[case:drop] 1.\n\n2.", True),  # D: drops the last character (not whitespace)
    ("[case:change] 1.", True),  # E: changes the first character
    ("[case:label] 1.", True),  # F: an unknown label
    ("[case:flaky] Wait, wrong.", True),  # G: malformed, then right: backtracking
    ("x" * 70 + ".", True),  # H: too long for a window, no boundary: refused, never asked
    ("[case:malformed] wrong answer", False),  # I: not correct: not selected
]


def steps(*argv: str) -> int:
    return main(["steps", *argv, "--no-progress"])


def judge_args(judge: FakeJudge, *extra: str) -> list[str]:
    return ["--judge-url", judge.url, "--judge-model", "fake-judge", "--judge-backoff", "0", *extra]


def read(eval_dir: Path) -> dict:
    return json.loads((eval_dir / "steps" / "judge-fake-judge" / "report.json").read_text())


def test_every_judge_answer_is_counted_retried_or_failed_with_its_reason(tmp_path):
    ev = write_evaluation(tmp_path / "ev", "base", {"aime": CASES})
    copy = ("--judge-mode", "copy", "--window-chars", "60")
    with FakeJudge() as judge:
        assert steps(str(ev), *judge_args(judge, *copy)) == 0
        asked = len(judge.requests)
        report = read(ev)
        b = report["benchmarks"]["aime"]
        assert (b["responses"], b["accepted"], b["failed"], b["failure_share"]) == (8, 3, 5, 5 / 8)
        assert b["failure_reasons"] == {"bad_label": 1, "malformed_json": 1, "not_verbatim": 2, "too_long": 1}
        assert b["windowed_responses"] == 1
        assert b["steps_per_response"]["mean"] == 2 and b["steps_per_response"]["median"] == 2  # 3, 2, 1 steps
        assert b["tokens_per_step"]["mean"] == pytest.approx(25 / 6)  # words 6+6+5, 3+2, 3
        assert b["tokens_per_step"]["median"] == 4  # of 2, 3, 3, 5, 6, 6
        shares = {k: v["share"] for k, v in b["labels"].items()}
        assert shares == pytest.approx({"problem_setup": 1 / 6, "forward_reasoning": 1 / 6, "verification": 1 / 6,
                                        "backtracking": 1 / 6, "subgoal_setting": 0, "backward_chaining": 0,
                                        "final_answer": 1 / 6, "other": 1 / 6})
        assert b["non_productive_share"]["share"] == pytest.approx(1 / 6)
        assert b["strategic_share"]["share"] == pytest.approx(2 / 6)
        # A: 2 windows, B: 1, C-F: 3 attempts each, G: 2, H: none
        assert asked == 2 + 1 + 4 * 3 + 2 and report["method"]["judge"]["throughput"]["requests"] == asked
        assert sorted(a for w, a in judge.requests if "[case:flaky]" in w) == [1, 2]
        rows = {r["problem_id"]: r for r in report["traces"]}
        assert "the steps joined end at trace character 17" in rows["aime-03"]["detail"]
        assert "at trace character 0: trace '[case:change]" in rows["aime-04"]["detail"]
        assert "label 'planning'" in rows["aime-05"]["detail"]
        assert rows["aime-00"]["labels"] == ["problem_setup", "forward_reasoning", "final_answer"]
        assert "aime-08" not in rows  # a wrong response
        md = (ev / "steps" / "judge-fake-judge" / "report.md").read_text()
        assert "judge `fake-judge`, copy mode, prompts v1" in md and "whitespace-separated words" in md
        assert judge.probes == 1

        assert steps(str(ev), *judge_args(judge, *copy)) == 0  # the cache answers everything
        assert len(judge.requests) == asked and judge.probes == 1  # nothing to ask: not even the probe
        again = read(ev)
        judged = again["method"]["judge"]
        assert judged["cached_windows"] == 8 and judged["throughput"]["requests"] == 0
        assert again["benchmarks"] == report["benchmarks"]

        assert steps(str(ev), *judge_args(judge, *copy, "--retry-failed")) == 0
        assert len(judge.requests) == asked + 4 * 3  # C-F asked again; H is refused before any request


def test_a_slow_judge_is_a_failure_not_a_crash_and_is_not_cached(tmp_path):
    ev = write_evaluation(tmp_path / "ev", "base", {"aime": [("[case:slow] 1.", True)]})
    with FakeJudge() as judge:
        for _ in range(2):
            assert steps(str(ev), *judge_args(judge, "--judge-timeout", "0.2", "--judge-attempts", "2")) == 0
            b = read(ev)["benchmarks"]["aime"]
            assert b["failure_reasons"] == {"timeout": 1} and b["failure_share"] == 1.0
        assert len(judge.requests) == 4  # a timeout is not a verdict: the rerun asked again
        assert not list((ev / "steps" / "cache").glob("*.json"))


def test_bad_judge_options_are_refused(tmp_path, capsys):
    ev = write_evaluation(tmp_path / "ev", "base", {"aime": CASES[:1]})
    for argv, says in ((["--judge-url", "http://x:1"], "--judge-url and --judge-model go together"),
                       (["--judge-url", "x:1", "--judge-model", "m"], "give an http(s) URL"),
                       (["--judge-url", "http://x:1", "--judge-model", "m", "--judge-api-key-env", "NO_SUCH_VAR_41"],
                        "NO_SUCH_VAR_41: that variable is not set"),
                       (["--judge-url", "http://x:1", "--judge-model", "m", "--judge-mode", "copy", "--judge-prompts",
                         str(PROMPTS_FILE)], "is a boundaries-mode prompts file"),
                       (["--compare"], "exactly two evaluations"), (["--bench", "gpqa"], "no benchmark ['gpqa']")):
        with pytest.raises(SystemExit) as exit_:
            steps(str(ev), *argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_sigkill_mid_run_leaves_no_process_and_a_cache_a_rerun_finishes(tmp_path):
    traces = [(f"Step {i}.\n\nSo {i}.", True) for i in range(3)]
    ev = write_evaluation(tmp_path / "ev", "base", {"aime": traces})
    cmd = [sys.executable, "-m", "megatron_apriel.entrypoints.eval", "steps", str(ev), "--judge-model", "fake-judge",
           "--judge-max-in-flight", "1", "--no-progress", "--judge-url"]
    with FakeJudge(block_after=1) as judge:
        proc = subprocess.Popen(cmd + [judge.url], cwd=REPO, env=launcher_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            # one request in flight at a time: the second arrives only once the first verdict is written
            assert judge.held.wait(timeout=120), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else ""
            children = psutil.Process(proc.pid).children(recursive=True)
            proc.kill()
            assert proc.wait(timeout=60) == -9
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    cached = list((ev / "steps" / "cache").glob("*.json"))
    assert len(cached) == 1 and Verdict.model_validate_json(cached[0].read_text()).failure is None
    with FakeJudge() as judge:
        done = subprocess.run(cmd + [judge.url], cwd=REPO, env=launcher_env(), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(judge.requests) == 2  # the cached trace is not asked again
    assert read(ev)["benchmarks"]["aime"]["accepted"] == 3


def test_another_prompts_file_is_recorded_and_never_reuses_the_cache(tmp_path):
    ev = write_evaluation(tmp_path / "ev", "base", {"aime": CASES[1:2]})
    custom = tmp_path / "short.yaml"
    custom.write_text(PROMPTS_FILE.read_text().replace("version: 2", "version: 7").replace("verbatim", "exactly"))
    with FakeJudge() as judge:
        assert steps(str(ev), *judge_args(judge)) == 0
        assert steps(str(ev), *judge_args(judge, "--judge-prompts", str(custom))) == 0
        assert len(judge.requests) == 2  # same trace and judge, other prompts: asked again
    section = read(ev)["method"]["judge"]
    assert (section["prompts_version"], section["prompts_file"]) == (7, str(custom))
    assert len(list((ev / "steps" / "cache").glob("*.json"))) == 2
