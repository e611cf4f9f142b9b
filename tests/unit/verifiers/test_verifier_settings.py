"""The run's verifier settings (``actor.verifiers.*``) reach the verifier processes, and a verifier's
failure detail reaches the rollout record and the actor's log."""

import asyncio
import logging
import threading
from http.server import HTTPServer

import pytest
from hydra import compose, initialize_config_module

from megatron_apriel.actor.episodes import Answer
from megatron_apriel.config import register_configs, to_run_config
from megatron_apriel.entrypoints.actor import verifier_pool
from megatron_apriel.records.config import RolloutConfig
from megatron_apriel.records.rollouts import DETAIL_CHARS
from megatron_apriel.records.stream import StreamReader
from megatron_apriel.testing.fake_fleet import FakeFleet
from megatron_apriel.verifiers import Outcome, VerifierResult, verify_group
from tests.unit.actor.test_actor import make_actor, run_with_trainer
from tests.unit.conftest import apriel, make_problem
from tests.unit.verifiers.test_verifiers_code import _FakeFusion

ADD = {"tests": [{"input": "2 3\n", "output": "5\n"}]}
PROGRAM = apriel("```python\na, b = map(int, input().split())\nprint(a + b)\n```")


class _Recording(_FakeFusion):
    """The SandboxFusion stand-in of the code verifier's tests, keeping every request."""

    requests: list = []

    def answer(self, body: dict) -> dict:
        self.requests.append(body)
        return super().answer(body)


@pytest.fixture
def fusion():
    server = HTTPServer(("127.0.0.1", 0), _Recording)
    _Recording.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", _Recording.requests
    server.shutdown()


def run_config(overrides):
    register_configs()
    with initialize_config_module(config_module="megatron_apriel.conf", version_base=None):
        return to_run_config(compose(config_name="tiny_cpu", overrides=["actor.verifier_workers=1", *overrides]))


def test_code_settings_of_the_run_reach_the_verifier_processes(fusion):
    url, requests = fusion
    run = run_config(["actor.verifiers.code.backend=sandbox_fusion", f"actor.verifiers.code.sandbox_fusion.url={url}",
                      "actor.verifiers.code.sandbox_fusion.run_timeout_s=3",
                      "actor.verifiers.code.sandbox_fusion.memory_mb=256"])
    problem = make_problem("code", ADD)
    with verifier_pool(run) as pool:
        good, crash = pool.submit(verify_group, "code", problem,
                                  [PROGRAM, PROGRAM.replace("print", "SANDBOX_ERROR = 1;print")]).result()
    assert [r["run_timeout"] for r in requests] == [3, 3] and {r["memory_limit_MB"] for r in requests} == {256}
    assert good.outcome is Outcome.CORRECT and good.success
    assert crash.outcome is Outcome.VERIFIER_ERROR and "SandboxFusion error: worker died" in crash.detail

    # with the defaults the pool runs the local sandbox: nothing reaches the server
    with verifier_pool(run_config([])) as pool:
        pool.submit(verify_group, "code", problem, [PROGRAM]).result()
    assert len(requests) == 2


def test_math_settings_of_the_run_reach_the_verifier_processes():
    problem = make_problem("math", "12345678")
    answer = apriel("\\boxed{12345678}")
    with verifier_pool(run_config(["actor.verifiers.math.max_answer_chars=4"])) as pool:
        short = pool.submit(verify_group, "math", problem, [answer]).result()[0]
    with verifier_pool(run_config([])) as pool:
        default = pool.submit(verify_group, "math", problem, [answer]).result()[0]
    assert short.outcome is Outcome.UNPARSABLE and default.outcome is Outcome.CORRECT


def test_a_verifier_failure_is_kept_in_the_record_and_logged(tmp_path, caplog):
    note = "RuntimeError: SandboxFusion error: worker died " + "x" * 2000
    fleet = FakeFleet(accuracy=0.5)
    rollout = RolloutConfig(group_size=2, groups_per_step=1, max_lag=0)
    actor = make_actor(tmp_path, fleet, rollout)
    calls = []

    inner = actor.episodes.step

    async def step(items):  # the first group's verifier fails on its second rollout
        answers = await inner(items)
        calls.append(len(items))
        if len(calls) == 1:
            answers[1] = Answer(answers[1].reply, VerifierResult(0.0, False, Outcome.VERIFIER_ERROR, note))
        return answers

    actor.episodes.step = step
    with caplog.at_level(logging.ERROR, logger="megatron_apriel.actor"):
        asyncio.run(run_with_trainer(tmp_path, actor, fleet, rollout, steps=1))
    first = StreamReader(tmp_path).next_group()
    assert first.dropped == "verifier_error"
    assert first.rollouts[1].outcome == "verifier_error" and first.rollouts[1].detail == note[:DETAIL_CHARS]
    logged = [r.getMessage() for r in caplog.records if "the verifier failed" in r.getMessage()]
    assert len(logged) == 1 and first.problem_id in logged[0] and "worker died" in logged[0]
