"""Code verifier and sandbox: correct programs pass; hostile programs are contained and score 0.

The hostile programs print the expected answer *only if their attack succeeded*, so a score of 0
shows containment. Needs root (network and mount namespaces); skipped otherwise.
"""

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from megatron_apriel.verifiers import Outcome, run_verifier
from megatron_apriel.verifiers.code import CodeVerifier, CodeVerifierConfig
from megatron_apriel.verifiers.sandbox import _UID_BASE, SandboxConfig, run_python
from megatron_apriel.verifiers.sandbox_fusion import SandboxFusionConfig
from tests.unit.conftest import apriel, make_problem

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the namespace sandbox needs root")
FAST = SandboxConfig(wall_timeout_s=2.0, cpu_time_s=2, memory_mb=512)
ADD = {"tests": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]}


def code(src: str) -> str:
    return apriel(f"```python\n{src}\n```")


def sandbox_processes() -> list[int]:
    """Live (non-zombie) processes owned by any sandbox uid."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except FileNotFoundError:
            continue
        if int(fields["Uid"].split()[0]) >= _UID_BASE and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry))
    return pids


@pytest.fixture
def verifier():
    v = CodeVerifier(CodeVerifierConfig(sandbox=FAST))
    yield v
    assert sandbox_processes() == [], "a sandboxed process survived its run"


@root_only
def test_stdin_stdout_correct_and_wrong(verifier):
    p = make_problem("code", ADD)
    assert run_verifier(verifier, p, code("a, b = map(int, input().split())\nprint(a + b)")).success
    r = run_verifier(verifier, p, code("a, b = map(int, input().split())\nprint(a * b)"))
    assert r.outcome is Outcome.WRONG and r.score == 0.0
    assert run_verifier(verifier, p, code("raise SystemExit(3)")).outcome is Outcome.WRONG
    assert run_verifier(verifier, p, apriel("print(5)")).outcome is Outcome.NO_ANSWER


@root_only
def test_function_call_style(verifier):
    p = make_problem("code", {"fn_name": "two_sum", "tests": [
        {"input": [[2, 7, 11, 15], 9], "output": [0, 1]}, {"input": [[3, 3], 6], "output": [0, 1]}]})
    good = ("class Solution:\n    def two_sum(self, nums, target):\n        seen = {}\n"
            "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
            "                return [seen[target - x], i]\n            seen[x] = i\n")
    assert run_verifier(verifier, p, code(good)).success
    assert not run_verifier(verifier, p, code("def two_sum(nums, target):\n    return [1, 0]")).success


@root_only
def test_infinite_loop_times_out(verifier):
    start = time.monotonic()
    r = run_verifier(verifier, make_problem("code", ADD), code("while True:\n    pass"))
    assert r.outcome is Outcome.TIMEOUT and r.score == 0.0
    assert time.monotonic() - start < 10


@root_only
def test_fork_bomb_is_contained(verifier):
    bomb = ("import os\nn = 0\nwhile True:\n    try:\n        os.fork()\n        n += 1\n"
            "    except OSError:\n        if n > 10000: print(5)\n")
    before = len(os.listdir("/proc"))
    r = run_verifier(verifier, make_problem("code", ADD), code(bomb))
    assert r.score == 0.0 and r.outcome in (Outcome.TIMEOUT, Outcome.WRONG)
    assert sandbox_processes() == []
    assert len(os.listdir("/proc")) < before + 50


@root_only
def test_memory_hog_is_contained(verifier):
    hog = "x = bytearray(4 << 30)\nprint(5)"
    r = run_verifier(verifier, make_problem("code", ADD), code(hog))
    assert r.outcome is Outcome.WRONG and "MemoryError" in r.detail


@root_only
def test_output_flood_is_cut(verifier):
    r = run_verifier(verifier, make_problem("code", ADD), code("while True:\n    print('x' * 100000)"))
    assert r.score == 0.0 and r.outcome is Outcome.WRONG  # killed by RLIMIT_FSIZE, not the wall clock


@root_only
def test_writes_outside_workdir_are_contained(verifier, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # even a world-writable directory of the host must stay untouched
    targets = [str(shared / "pwned"), "/var/tmp/apriel_pwned", "/root/apriel_pwned", "/etc/apriel_pwned"]
    attack = ("import sys\nok = 0\nfor t in %r:\n    try:\n        open(t, 'w').write('x')\n        ok += 1\n"
              "    except OSError:\n        pass\nif ok == len(%r): print(5)\n") % (targets[2:], targets[2:])
    attack += "\nfor t in %r:\n    open(t, 'w').write('x')\n" % (targets[:2],)
    r = run_verifier(verifier, make_problem("code", ADD), code(attack))
    assert r.score == 0.0
    for t in targets:
        assert not os.path.exists(t), t


@root_only
def test_no_network(verifier):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    attack = ("import socket\nfor host in ('127.0.0.1', '1.1.1.1'):\n    try:\n"
              "        socket.create_connection((host, %d if host == '127.0.0.1' else 53), timeout=1)\n"
              "        print(5)\n        break\n    except OSError:\n        pass\n") % port
    try:
        r = run_verifier(verifier, make_problem("code", ADD), code(attack))
    finally:
        server.close()
    assert r.score == 0.0 and r.outcome is Outcome.WRONG


@root_only
def test_parent_environment_is_hidden(verifier, monkeypatch):
    monkeypatch.setenv("APRIEL_TEST_SECRET", "5")
    attack = ("import os\nv = os.environ.get('APRIEL_TEST_SECRET')\nif v is None:\n    try:\n"
              "        raw = open('/proc/%d/environ', 'rb').read()\n"
              "        v = '5' if b'APRIEL_TEST_SECRET' in raw else None\n"
              "    except OSError:\n        pass\nprint(v)\n") % os.getpid()
    r = run_verifier(verifier, make_problem("code", ADD), code(attack))
    assert r.score == 0.0


@root_only
def test_run_python_scrubbed_env_and_cleanup():
    before = {n for n in os.listdir("/tmp") if n.startswith("apriel-sbx")}
    r = run_python("import os\nprint(sorted(os.environ))\nprint(os.getuid())", "", FAST)
    env, uid = r.stdout.splitlines()
    assert set(eval(env)) <= {"PATH", "LANG", "HOME", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "OMP_NUM_THREADS"}
    assert int(uid) >= _UID_BASE
    assert {n for n in os.listdir("/tmp") if n.startswith("apriel-sbx")} == before


class _FakeFusion(BaseHTTPRequestHandler):
    """A stand-in SandboxFusion: 'runs' the known good program by adding the two stdin numbers."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/run_code" and body["language"] == "python"
        if "SANDBOX_ERROR" in body["code"]:
            reply = {"status": "SandboxError", "message": "worker died"}
        elif "while True" in body["code"]:
            reply = {"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "stdout": "", "stderr": "",
                                                         "return_code": None, "execution_time": 10.0}}
        else:
            a, b = map(int, body["stdin"].split())
            reply = {"status": "Success", "run_result": {"status": "Finished", "stdout": f"{a + b}\n",
                                                          "stderr": "", "return_code": 0, "execution_time": 0.01}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_sandbox_fusion_backend_against_fake_server():
    server = HTTPServer(("127.0.0.1", 0), _FakeFusion)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        cfg = CodeVerifierConfig(backend="sandbox_fusion",
                                 sandbox_fusion=SandboxFusionConfig(url=f"http://127.0.0.1:{server.server_port}"))
        v = CodeVerifier(cfg)
        p = make_problem("code", ADD)
        assert run_verifier(v, p, code("print(sum(map(int, input().split())))")).success
        assert run_verifier(v, p, code("while True: pass")).outcome is Outcome.TIMEOUT
        r = run_verifier(v, p, code("SANDBOX_ERROR"))
        assert r.outcome is Outcome.VERIFIER_ERROR and "worker died" in r.detail
    finally:
        server.shutdown()
        server.server_close()
