"""Tool calls are data: hostile calls run nothing, each trajectory has its own state, and a call
that hangs (even inside one C-level operation) is answered with an error after its time limit."""

import threading
import time

import pytest

from megatron_apriel.envs.calls import ERROR_PREFIX, BadCall, Call, parse_calls
from megatron_apriel.envs.config import ToolCallConfig
from megatron_apriel.envs.isolation import run_forked
from megatron_apriel.envs.tools import Toolbox
from tests.unit.conftest import apriel


def test_calls_are_read_as_names_and_literals():
    assert parse_calls("[cd(folder='docs'), sort('a.txt'), f(n=-2, xs=[1, 2.5], d={'k': (1, None)})]") == [
        Call("cd", (), {"folder": "docs"}), Call("sort", ("a.txt",), {}),
        Call("f", (), {"n": -2, "xs": [1, 2.5], "d": {"k": (1, None)}})]
    assert parse_calls("```\nls(a=True)\n```") == [Call("ls", (), {"a": True})]  # BFCL strips fences, adds brackets
    assert parse_calls(apriel("[pwd()]")) == [Call("pwd")]
    assert parse_calls('<tool_calls>[{"name": "cd", "arguments": {"folder": "x"}}]</tool_calls>') == [
        Call("cd", (), {"folder": "x"})]


@pytest.mark.parametrize("text", ["The file is moved.", "[]", "", "[1, 'a']", "[ls.__class__]", "ls(", "[x][0]"])
def test_an_answer_without_a_call_ends_the_tool_loop(text):
    assert parse_calls(text) is None


HOSTILE = [
    "[__import__('os').system('touch X')]",
    "[open('X', 'w')]",
    "[ls.__class__()]",
    "[ls(a=ls.__class__)]",
    "[ls.__init__.__globals__['os'].system('touch X')]",
    "[cd(folder=lambda: open('X', 'w'))]",
    "[cd(folder=open('X', 'w'))]",
    "[cd(*['X'])]",
    "[cd(**{'folder': 'X'})]",
    "[eval(\"open('X', 'w')\")]",
    "[exec('import os')]",
    "[getattr(ls, '__globals__')]",
    "[_load_scenario({})]",
    "[__class__()]",
    "[touch(file_name=f'{X}')]",
    '<tool_calls>[{"name": "__import__", "arguments": {"name": "os"}}]</tool_calls>',
    '<tool_calls>[{"name": "open", "arguments": {"file": "X", "mode": "w"}}]</tool_calls>',
    "<tool_calls>[{not json</tool_calls>",
]


@pytest.fixture
def bfcl():
    from megatron_apriel.envs.bfcl_multi_turn import bfcl_data_dir
    from tests.ci import skip_or_fail

    if bfcl_data_dir() is None:
        skip_or_fail("bfcl-eval is not installed: pip install --no-deps bfcl-eval==2026.3.23")
    from megatron_apriel.envs import bfcl_multi_turn

    return bfcl_multi_turn


def test_hostile_calls_run_nothing_and_each_gets_a_tool_error(bfcl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    problem = next(p for p in bfcl.load_problems("multi_turn_base") if p.id == "bfcl-multi_turn_base_0")
    episode = bfcl.BfclMultiTurnEnvironment().start(problem)  # the default: each call in a forked child
    for text in HOSTILE:
        reply = episode.step(text)
        assert len(reply.messages) == 1 and reply.messages[0]["role"] == "tool", text
        assert reply.messages[0]["content"].startswith(ERROR_PREFIX), (text, reply.messages[0])
    assert list(tmp_path.iterdir()) == []
    checker = bfcl._bfcl().checker
    assert checker.state_checker(episode.model.instances, bfcl.new_instances(problem.reference))["valid"]


def test_bfcl_own_executor_would_have_run_one_of_them(bfcl, tmp_path, monkeypatch):
    """Why we parse: BFCL's executor evaluates the call string (here our own, harmless one)."""
    monkeypatch.chdir(tmp_path)
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    before = set(vars(multi_turn_utils))
    multi_turn_utils.execute_multi_turn_func_call(["open('X', 'w')"], {}, ["MathAPI"], "safety_test", "t0")
    for key in set(vars(multi_turn_utils)) - before:
        del vars(multi_turn_utils)[key]
    assert (tmp_path / "X").exists()


def test_eight_rollouts_of_one_problem_have_their_own_state(bfcl):
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    problem = next(p for p in bfcl.load_problems("multi_turn_base") if p.id == "bfcl-multi_turn_base_0")
    before = set(vars(multi_turn_utils))
    episodes = [bfcl.BfclMultiTurnEnvironment().start(problem) for _ in range(8)]
    for i, episode in enumerate(episodes):
        assert episode.step(f"[mkdir(dir_name='run{i}')]").messages[0]["content"] == "None"
    for i, episode in enumerate(episodes):
        listing = episode.step("[ls()]").messages[0]["content"]
        assert f"run{i}" in listing and [j for j in range(8) if f"run{j}" in listing] == [i], listing
    fs = [e.model.instances["GorillaFileSystem"] for e in episodes]
    assert len({id(f) for f in fs}) == 8 and set(vars(multi_turn_utils)) == before


class _Tools:
    def __init__(self):
        self.count = 0

    def bump(self) -> int:
        self.count += 1
        return self.count

    def bump_then_hang(self) -> None:
        self.count += 100
        threading.Event().wait()

    def fail(self) -> None:
        raise KeyError("no such record")


def test_a_hanging_call_times_out_with_an_error_and_changes_nothing():
    box = Toolbox({"t": _Tools()}, ToolCallConfig(timeout_s=0.3))
    assert box.answer(Call("bump")) == "1"
    started = time.monotonic()
    answer = box.answer(Call("bump_then_hang"))
    assert answer == f"{ERROR_PREFIX}the call timed out after 0.3 s" and time.monotonic() - started < 5
    assert box.answer(Call("bump")) == "2"  # the hung call's change died with its process
    assert box.answer(Call("fail")) == f"{ERROR_PREFIX}'no such record'"
    assert box.answer(Call("nothing")) == f"{ERROR_PREFIX}name 'nothing' is not defined"
    assert box.answer(BadCall("x.y()", "no")) == f"{ERROR_PREFIX}no"


def test_a_call_stuck_in_one_c_operation_times_out(bfcl):
    """``7 ** 10**8`` runs minutes inside one bytecode, holding the GIL: only a process can stop it."""
    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code.math_api import MathAPI

    box = Toolbox({"MathAPI": MathAPI()}, ToolCallConfig(timeout_s=0.5))
    started = time.monotonic()
    assert box.answer(parse_calls("[power(base=7, exponent=100000000)]")[0]).endswith("timed out after 0.5 s")
    assert time.monotonic() - started < 5
    assert box.answer(parse_calls("[add(a=1, b=2)]")[0]) == '{"result": 3}'


def test_run_forked_returns_values_and_errors_but_not_the_childs_memory():
    seen = []
    assert run_forked(lambda: seen.append(1) or len(seen), timeout_s=5, memory_mb=256).value == 1
    assert seen == []
    failed = run_forked(lambda: 1 / 0, timeout_s=5, memory_mb=256)
    assert not failed.ok and failed.error.startswith("ZeroDivisionError")
    grown = run_forked(lambda: len(bytearray(600 << 20)), timeout_s=5, memory_mb=256)
    assert not grown.ok and grown.error.startswith("MemoryError")
