"""The actor process SIGKILLed in the middle of a multi-turn trajectory (issue 50, faults): after the
restart that trajectory starts again from its first turn, and the stream never holds half of one.

The real actor process (``python -m megatron_apriel.entrypoints.actor``, its episode workers, the
calculator environment) against ``FakeToolFleet`` served over real HTTP: the fake model calls the
calculator twice, then answers (three model turns). The fleet holds the first request of a second
turn it sees; while it is held (its trajectory is half done: one call made and answered) the test
kills the actor. The restarted actor (the same command) resumes from the stream.
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from megatron_apriel.config import compose_config, save_run_config, to_run_config
from megatron_apriel.records.stream import StreamReader, TrainerProgress, write_progress
from megatron_apriel.testing.fake_fleet import TOOL_RESULT, FakeToolFleet, calculator_policy
from megatron_apriel.tokenizer import load_tokenizer
from tests.conftest import new_run_dir
from tests.unit.conftest import launcher_env

PROBLEMS, GROUP_SIZE, GROUPS_PER_STEP, HOLD_NTH = 12, 2, 2, 3
"""One group at a time (``actor.max_in_flight=1``): the first two are written when the third one's
second turn is held, so the actor is killed after a snapshot of the stream, with that group in flight."""
QUESTION = re.compile(r"What is (\d+) \+ \d+ \+ \d+\? Use the calculator\.")


class HttpToolFleet:
    """``FakeToolFleet`` over HTTP, for an actor in another process. It holds the second turn of
    the ``HOLD_NTH``-th problem started (``held`` is set) until ``release`` is, and counts each
    problem's first-turn requests."""

    def __init__(self, fleet: FakeToolFleet, tokenizer):
        self.fleet, self.tokenizer = fleet, tokenizer
        self.held, self.release = threading.Event(), threading.Event()
        self.held_question = None
        self.first_turns: Counter = Counter()
        self.started: list[str] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.answer(self, b"")

            def do_POST(self):
                owner.answer(self, self.rfile.read(int(self.headers["Content-Length"])))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        path = handler.path.split("?")[0]
        if path == "/metrics":  # the client's stall watchdog reads the tokens generated
            self._send(handler, 200, f"vllm:generation_tokens_total {self.fleet.tokens}\n".encode())
            return
        if path == "/inference/v1/generate":
            self._observe(json.loads(body))
        with self._lock:  # FakeToolFleet draws from one random generator
            response = asyncio.run(self.fleet.handle(httpx.Request(handler.command, self.url + handler.path,
                                                                   content=body)))
        self._send(handler, response.status_code, response.content)

    def _observe(self, body: dict) -> None:
        context = self.tokenizer.decode(body["token_ids"], skip_special_tokens=False)
        question = problem_id(context)
        calls = len(TOOL_RESULT.findall(context))
        with self._lock:
            if calls == 0:
                self.first_turns[question] += 1
                if question not in self.started:
                    self.started.append(question)
            hold = (calls == 1 and not self.held.is_set() and len(self.started) >= HOLD_NTH
                    and question == self.started[HOLD_NTH - 1])
        if hold:
            self.held_question = question
            self.held.set()
            self.release.wait()

    @staticmethod
    def _send(handler, status: int, content: bytes) -> None:
        try:
            handler.send_response(status)
            handler.send_header("Content-Length", str(len(content)))
            handler.end_headers()
            handler.wfile.write(content)
        except (BrokenPipeError, ConnectionResetError):  # the held request's actor was killed
            pass

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def problem_id(context: str) -> str:
    """The id of the problem a request's context asks (``sum3-i`` asks "What is i + ...")."""
    return f"sum3-{int(QUESTION.search(context).group(1))}"


def write_problems(path: Path) -> None:
    rows = [{"id": f"sum3-{i}", "domain": "math",
             "prompt": [{"role": "user", "content": f"What is {i} + {2 * i + 1} + {i * i}? Use the calculator."}],
             "reference": json.dumps({"answer": i + 2 * i + 1 + i * i}),
             "metadata": json.dumps({"environment": "arithmetic"})} for i in range(PROBLEMS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def start_actor(run: Path, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_apriel.entrypoints.actor", "--run-dir", str(run)],
                            stdout=log, stderr=subprocess.STDOUT, env=launcher_env(), start_new_session=True)


def wait_until(what: str, done, proc: subprocess.Popen, log_path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None, f"the actor exited ({proc.returncode}) before {what}:\n" \
                                    f"{log_path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s:\n{log_path.read_text()[-4000:]}"
        time.sleep(0.05)


def groups(run: Path) -> list:
    root = run / "rollouts"
    return StreamReader(root).read_all() if root.exists() else []


@pytest.fixture
def actor_run(tmp_path, tiny_base):
    run = new_run_dir(tmp_path, tiny_base)
    write_problems(tmp_path / "sums.jsonl")
    cfg = to_run_config(compose_config("tiny_cpu", [
        f"run_dir={run}", f"actor.data=[{tmp_path / 'sums.jsonl'}]", "+actor.environments={math: arithmetic}",
        f"rollout.group_size={GROUP_SIZE}", f"rollout.groups_per_step={GROUPS_PER_STEP}",
        "rewards.max_len=200", "actor.max_prompt_tokens=300", "actor.max_in_flight=1",
        "rewards.filter_zero_advantage_groups=false"]))
    fleet = HttpToolFleet(FakeToolFleet(load_tokenizer(str(run / "base")), calculator_policy),
                          load_tokenizer(str(run / "base")))
    cfg.fleet.servers = [fleet.url]
    save_run_config(cfg)
    write_progress(run / "rollouts", TrainerProgress(step=0, filled=0, cursor=0, version=0))
    yield run, fleet
    fleet.close()


def test_an_actor_killed_mid_trajectory_starts_it_again_and_writes_no_half_of_it(actor_run):
    run, fleet = actor_run
    log_path = run / "actor.log"
    with open(log_path, "w") as log:
        actor = start_actor(run, log)
        try:
            wait_until("the held second turn, the groups before it written",
                       lambda: fleet.held.is_set() and len(groups(run)) == HOLD_NTH - 1, actor, log_path)
            killed_at = len(groups(run))
            os.killpg(actor.pid, signal.SIGKILL)  # the actor, its episode workers and verifier workers
            actor.wait(30)
        finally:
            if actor.poll() is None:
                os.killpg(actor.pid, signal.SIGKILL)
                actor.wait()
        question = fleet.held_question
        assert question not in {g.problem_id for g in groups(run)}  # its group was not written
        assert fleet.first_turns[question] >= 1
        before = fleet.first_turns[question]
        fleet.release.set()  # the held request answers a dead actor

        actor = start_actor(run, log)
        try:
            wait_until("the held trajectory's group", lambda: question in {g.problem_id for g in groups(run)},
                       actor, log_path)
            actor.send_signal(signal.SIGTERM)
            assert actor.wait(60) == 0, log_path.read_text()[-4000:]
        finally:
            if actor.poll() is None:
                os.killpg(actor.pid, signal.SIGKILL)
                actor.wait()

    written = groups(run)
    assert [g.seq for g in written] == list(range(len(written))) and len(written) > killed_at
    assert sum(g.problem_id == question for g in written) == 1
    # started again from its first turn: the fleet got that question's first request (its G first
    # turns, one request of n=G) once more
    assert fleet.first_turns[question] == before + 1
    for g in written:  # every trajectory whole: two calls answered, then the answer
        for r in g.rollouts:
            assert len(r.model_turns) == 3 and not r.truncated and r.score == 1.0, (g.problem_id, r.detail)
    # resumed from the stream's last snapshot (the held group in flight there, or drawn again after it)
    assert f"resumed at group {killed_at} (" in log_path.read_text()

