"""Code verifier: run the last ```python block of the final response against the reference tests.

Reference (JSON)::

    {"tests": [{"input": "1 2\\n", "output": "3\\n"}, ...]}                 # stdin/stdout style
    {"fn_name": "add", "tests": [{"input": [1, 2], "output": 3}, ...]}     # function-call style

In function-call style `input` is the list of positional arguments; the function is looked up at
module level, else as a method of a class `Solution` (LeetCode style). An optional ``"prelude"``
(Python source) runs before the candidate's code, in both styles: the imports a benchmark's own
harness provides (LiveCodeBench's starter code uses ``List[int]`` without importing it). Each test runs in its own
sandbox process; the reward is 1 only if every test passes (early exit on the first failure).
stdout is compared line by line with trailing whitespace ignored and numbers compared with a 1e-6
relative tolerance; function results are compared as JSON values with the same tolerance.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Protocol

from megatron_apriel.records.rollouts import Problem
from megatron_apriel.verifiers.base import (
    Outcome,
    VerifierResult,
    correct,
    extract_final_response,
    failed,
    strip_reasoning,
)
from megatron_apriel.verifiers.config import CodeVerifierConfig
from megatron_apriel.verifiers.sandbox import LocalSandbox, RunResult
from megatron_apriel.verifiers.sandbox_fusion import SandboxFusionRunner

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_SENTINEL = "__APRIEL_RESULT__"
_HARNESS = """\
import io, json, sys
_args = json.loads(sys.stdin.read())
_stdout, sys.stdout = sys.stdout, io.StringIO()
_ns = {{"__name__": "__solution__"}}
exec(compile({source!r}, "solution.py", "exec"), _ns)
_fn = _ns.get({name!r}) or getattr(_ns["Solution"](), {name!r})
_result = _fn(*_args)
sys.stdout = _stdout
print({sentinel!r} + json.dumps(_result))
"""


class CodeRunner(Protocol):
    def run(self, code: str, stdin: str = "") -> RunResult: ...


def build_runner(config: CodeVerifierConfig) -> CodeRunner:
    if config.backend == "local":
        return LocalSandbox(config.sandbox)
    return SandboxFusionRunner(config.sandbox_fusion)


def extract_code(completion: str) -> str | None:
    """The last fenced code block of the final response, or None."""
    blocks = _FENCE.findall(extract_final_response(strip_reasoning(completion)))
    return blocks[-1] if blocks else None


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


def _token(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def outputs_match(got: str, want: str) -> bool:
    """stdout comparison: lines with trailing blanks stripped, tokens equal or numerically close."""
    g = [line.split() for line in got.rstrip().splitlines()]
    w = [line.split() for line in want.rstrip().splitlines()]
    return len(g) == len(w) and all(_close([_token(t) for t in x], [_token(t) for t in y]) for x, y in zip(g, w))


class CodeVerifier:
    domain = "code"

    def __init__(self, config: CodeVerifierConfig | None = None, runner: CodeRunner | None = None) -> None:
        self.config = config or CodeVerifierConfig()
        self._runner = runner  # built on first use: the local sandbox checks privileges when built

    @property
    def runner(self) -> CodeRunner:
        if self._runner is None:
            self._runner = build_runner(self.config)
        return self._runner

    def verify(self, problem: Problem, completion: str) -> VerifierResult:
        ref = problem.reference
        if not isinstance(ref, dict) or not ref.get("tests"):
            raise ValueError(f"code problem {problem.id}: reference needs a non-empty 'tests' list.")
        source = extract_code(completion)
        if source is None:
            return failed(Outcome.NO_ANSWER, "no ```python block in the final response")
        prelude = ref.get("prelude") or ""
        if prelude:
            source = prelude.rstrip("\n") + "\n" + source
        fn_name = ref.get("fn_name")
        for i, test in enumerate(ref["tests"]):
            if fn_name:
                program = _HARNESS.format(source=source, name=fn_name, sentinel=_SENTINEL)
                run = self.runner.run(program, json.dumps(test["input"]))
            else:
                run = self.runner.run(source, test["input"])
            if run.timed_out:
                return failed(Outcome.TIMEOUT, f"test {i}: timed out after {run.wall_s:.1f}s")
            if not self._passed(run, test["output"], fn_name):
                return failed(Outcome.WRONG, f"test {i} of {len(ref['tests'])} failed (rc={run.returncode}): "
                                             f"{run.stderr[-500:]}")
        return correct(f"{len(ref['tests'])} tests passed")

    @staticmethod
    def _passed(run: RunResult, want: Any, fn_name: str | None) -> bool:
        if run.returncode != 0:
            return False
        if not fn_name:
            return outputs_match(run.stdout, want)
        lines = [line for line in run.stdout.splitlines() if line.startswith(_SENTINEL)]
        if not lines:
            return False
        try:
            got = json.loads(lines[-1][len(_SENTINEL):])
        except json.JSONDecodeError:
            return False  # the candidate's return value is not JSON: a wrong answer
        return _close(got, want)
