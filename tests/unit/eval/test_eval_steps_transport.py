"""apriel-eval steps against a judge that is not there, or is busy: a refused connection, a 401 or
a 404 stops the command at once with one line saying what to fix and nothing cached; HTTP 429
with Retry-After is retried after that delay (an injected sleep: no test waits for real, apart
from one 50 ms Retry-After through the command line)."""

import asyncio
import json
import time

import pytest

from megatron_apriel.entrypoints.eval import main
from megatron_apriel.eval.steps.cache import VerdictCache
from megatron_apriel.eval.steps.judge import JudgeConfig, judge_all
from megatron_apriel.eval.steps.prompts import load_prompts
from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.testing.fake_judge import FakeJudge
from tests.steps_fixtures import write_evaluation

WINDOW = "We are given 2 + 3.\n\nSo 2 + 3 = 5."


@pytest.mark.parametrize("where, judge_kwargs, extra, says", [
    ("down", {}, [], "cannot reach the judge at http://127.0.0.1:"),
    ("url", {}, [], "HTTP 404 from http://127.0.0.1:"),
    ("model", {}, ["--judge-model", "no-such-model"], "--judge-model 'no-such-model' (a name the server serves"),
    ("key", {"api_key": "secret"}, [], "refused the key (HTTP 401"),
])
def test_a_judge_that_is_not_there_stops_the_command_at_once(where, judge_kwargs, extra, says, tmp_path, capsys,
                                                            monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    ev = write_evaluation(tmp_path / "ev", "base", {"aime": [(WINDOW, True)]})
    with FakeJudge(**judge_kwargs) as judge:
        url = {"down": f"http://127.0.0.1:{free_port()}", "url": judge.url + "/api"}.get(where, judge.url)
        start = time.monotonic()
        with pytest.raises(SystemExit) as exit_:
            main(["steps", str(ev), "--no-progress", "--judge-url", url, "--judge-model", "fake-judge", *extra])
        elapsed = time.monotonic() - start
        assert judge.requests == []  # no window was asked
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and elapsed < 10 and says in err, err
    assert err.count("\n") == 1 and err.startswith("apriel-eval steps: error: ")
    assert not (ev / "steps").exists()  # nothing cached, no report


@pytest.mark.parametrize("retry_after, delays", [
    (7, [7.0]),  # the server's delay
    (0, [1.0, 2.0]),  # none given: backoff_s, doubled
    (1000, [120.0]),  # at most max_backoff_s
])
def test_a_429_is_retried_after_the_delay(retry_after, delays, tmp_path):
    waited = []
    with FakeJudge(throttle=len(delays), retry_after=retry_after) as judge:
        async def sleep(seconds: float) -> None:
            waited.append((seconds, len(judge.requests)))  # the requests the judge had seen when the wait began

        cfg = JudgeConfig(url=judge.url, model="fake-judge", max_attempts=3)
        cache = VerdictCache(tmp_path / "cache")
        verdicts, tally = asyncio.run(judge_all({"d": WINDOW}, cfg=cfg, prompts=load_prompts(), cache=cache,
                                                sleep=sleep))
        assert judge.throttled == len(delays) and len(judge.requests) == len(delays) + 1
    assert waited == [(d, i + 1) for i, d in enumerate(delays)]  # each retry only after its wait
    verdict = verdicts["d"]
    assert verdict.failure is None and verdict.attempts == len(delays) + 1 and len(verdict.steps) == 2
    assert tally.failures == {"judge_error": len(delays)} and tally.requests == len(delays) + 1


def test_a_429_through_the_command_line(tmp_path):
    ev = write_evaluation(tmp_path / "ev", "base", {"aime": [(WINDOW, True)]})
    with FakeJudge(throttle=1, retry_after=0.05) as judge:
        assert main(["steps", str(ev), "--no-progress", "--judge-url", judge.url, "--judge-model", "fake-judge"]) == 0
        assert judge.throttled == 1 and len(judge.requests) == 2
    report = json.loads((ev / "steps" / "judge-fake-judge" / "report.json").read_text())
    assert report["benchmarks"]["aime"]["accepted"] == 1
    assert report["method"]["judge"]["throughput"]["attempt_failures"] == {"judge_error": 1}
