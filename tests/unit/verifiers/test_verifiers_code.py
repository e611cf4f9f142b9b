"""Code verifier and sandbox: correct programs pass; hostile programs are contained.

Each security test runs its attack twice: once through `Unsandboxed` (a plain child process of the
test, with its environment and privileges: the control, where the attack must work) and once in
the sandbox, where it must not. An attack that solves ADD only if it succeeded scores 1 in the
control and 0 in the sandbox; attacks on the host's files are checked on the host. Needs root
(network and mount namespaces): skipped otherwise, and failed under CI (tests/ci.py).
"""

import json
import os
import secrets
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from megatron_apriel.verifiers import Outcome, run_verifier
from megatron_apriel.verifiers.code import CodeVerifier
from megatron_apriel.verifiers.config import CodeVerifierConfig, SandboxConfig, SandboxFusionConfig
from megatron_apriel.verifiers.sandbox import _UID_BASE, RunResult, run_python
from tests.unit.conftest import apriel, make_problem

LIMITS = dict(wall_timeout_s=2.0, cpu_time_s=2, memory_mb=512)
ADD = {"tests": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]}


def code(src: str) -> str:
    return apriel(f"```python\n{src}\n```")


def solves_add_if(attack: str) -> str:
    """A candidate that runs `attack` (which sets `ok`), then solves ADD only if the attack worked."""
    return code(f"{attack}\na, b = map(int, input().split())\nprint(a + b if ok else 'contained')")


def sandbox_processes(uids: set[int], zombies: bool = False) -> list[int]:
    """Processes owned by one of the sandbox ``uids`` (live ones; with ``zombies``, those too). Only
    this test's uids: another test running beside it (pytest-xdist) may have sandboxes of its own."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (FileNotFoundError, ProcessLookupError):  # it exited between the listing and the read
            continue
        if int(fields["Uid"].split()[0]) in uids and (zombies or not fields["State"].strip().startswith("Z")):
            pids.append(int(entry))
    return pids


@pytest.fixture
def sandbox_uids(monkeypatch) -> set[int]:
    """The sandbox uids this test's runs used (each run kills its uid's processes at its end)."""
    import megatron_apriel.verifiers.sandbox as sandbox

    used: set[int] = set()
    kill = sandbox._kill_uid

    def recording(uid: int) -> None:
        used.add(uid)
        kill(uid)
    monkeypatch.setattr(sandbox, "_kill_uid", recording)
    return used


class Unsandboxed:
    """The control runner: the candidate as a plain child of the test process, with the test's
    environment, uid and network, under the interpreter the sandbox uses. No protection at all."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def run(self, code: str, stdin: str = "") -> RunResult:
        start = time.monotonic()
        proc = subprocess.run([SandboxConfig.python, "-c", code], input=stdin, capture_output=True, text=True,
                              timeout=30, cwd=self.workdir)
        return RunResult(proc.returncode, proc.stdout, proc.stderr, False, time.monotonic() - start)


@pytest.fixture
def fast(needs_root):
    return SandboxConfig(**LIMITS)


@pytest.fixture
def verifier(fast, sandbox_uids):
    v = CodeVerifier(CodeVerifierConfig(sandbox=fast))
    yield v
    assert sandbox_processes(sandbox_uids) == [], "a sandboxed process survived its run"


@pytest.fixture
def uncontained(tmp_path):
    workdir = tmp_path / "control"
    workdir.mkdir()
    return CodeVerifier(runner=Unsandboxed(workdir))


def test_stdin_stdout_correct_and_wrong(verifier):
    p = make_problem("code", ADD)
    assert run_verifier(verifier, p, code("a, b = map(int, input().split())\nprint(a + b)")).success
    r = run_verifier(verifier, p, code("a, b = map(int, input().split())\nprint(a * b)"))
    assert r.outcome is Outcome.WRONG and r.score == 0.0
    assert run_verifier(verifier, p, code("raise SystemExit(3)")).outcome is Outcome.WRONG
    assert run_verifier(verifier, p, apriel("print(5)")).outcome is Outcome.NO_ANSWER


def test_function_call_style(verifier):
    p = make_problem("code", {"fn_name": "two_sum", "tests": [
        {"input": [[2, 7, 11, 15], 9], "output": [0, 1]}, {"input": [[3, 3], 6], "output": [0, 1]}]})
    good = ("class Solution:\n    def two_sum(self, nums, target):\n        seen = {}\n"
            "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
            "                return [seen[target - x], i]\n            seen[x] = i\n")
    assert run_verifier(verifier, p, code(good)).success
    assert not run_verifier(verifier, p, code("def two_sum(nums, target):\n    return [1, 0]")).success


def test_infinite_loop_times_out(verifier):
    start = time.monotonic()
    r = run_verifier(verifier, make_problem("code", ADD), code("while True:\n    pass"))
    assert r.outcome is Outcome.TIMEOUT and r.score == 0.0
    assert time.monotonic() - start < 10


def test_fork_bomb_is_contained(verifier, sandbox_uids):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_verifier(verifier, make_problem("code", ADD), code(bomb))
    assert r.outcome in (Outcome.TIMEOUT, Outcome.WRONG)
    assert len(sandbox_uids) == 1
    assert sandbox_processes(sandbox_uids) == []
    assert len(sandbox_processes(sandbox_uids, zombies=True)) < 50  # the bomb's zombies were reaped


def test_process_limit(verifier, uncontained, fast):
    """Holding 3x max_processes processes at once works unsandboxed, not as the sandbox uid (RLIMIT_NPROC)."""
    want = 3 * fast.max_processes
    attack = solves_add_if(
        f"import os, time\nheld = 0\nfor _ in range({want}):\n    try:\n        pid = os.fork()\n"
        f"    except OSError:\n        break\n    if pid == 0:\n        time.sleep(1)\n        os._exit(0)\n"
        f"    held += 1\nok = held == {want}")
    p = make_problem("code", ADD)
    assert run_verifier(uncontained, p, attack).success
    r = run_verifier(verifier, p, attack)
    assert r.outcome is Outcome.WRONG and r.score == 0.0


def test_memory_hog_is_contained(verifier):
    hog = "x = bytearray(4 << 30)\nprint(5)"
    r = run_verifier(verifier, make_problem("code", ADD), code(hog))
    assert r.outcome is Outcome.WRONG and "MemoryError" in r.detail


def test_output_flood_is_cut(verifier):
    r = run_verifier(verifier, make_problem("code", ADD), code("while True:\n    print('x' * 100000)"))
    assert r.score == 0.0 and r.outcome is Outcome.WRONG  # killed by RLIMIT_FSIZE, not the wall clock


def test_writes_outside_workdir_are_contained(verifier, uncontained, tmp_path):
    """Files the control writes on the host (private tmpfs dirs, a root-owned home) stay unwritten."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # even a world-writable directory of the host must stay untouched
    tag = secrets.token_hex(4)
    targets = [shared / "pwned", Path("/var/tmp") / f"apriel-pwned-{tag}", Path.home() / f"apriel-pwned-{tag}"]
    if os.path.isdir("/dev/shm"):
        targets.append(Path("/dev/shm") / f"apriel-pwned-{tag}")
    attack = code("for t in %r:\n    try:\n        open(t, 'w').write('x')\n    except OSError:\n        pass\n"
                  "print(5)" % ([str(t) for t in targets],))
    p = make_problem("code", ADD)
    try:
        run_verifier(uncontained, p, attack)
        assert [t for t in targets if not t.exists()] == []  # the control reaches every target
        for t in targets:
            t.unlink()
        run_verifier(verifier, p, attack)
        assert [t for t in targets if t.exists()] == []
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


def _accept_all(server: socket.socket) -> int:
    """Connections waiting in the listener's backlog (accepted and closed)."""
    n = 0
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


def test_no_network(verifier, uncontained):
    """A listener on the host's loopback is reachable unsandboxed, not from the sandbox's namespace."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        attack = solves_add_if("import socket\ntry:\n"
                               "    socket.create_connection(('127.0.0.1', %d), timeout=1).close()\n"
                               "    ok = True\nexcept OSError:\n    ok = False" % server.getsockname()[1])
        p = make_problem("code", ADD)
        assert run_verifier(uncontained, p, attack).success
        assert _accept_all(server) == len(ADD["tests"])  # one connection per test reached the host
        r = run_verifier(verifier, p, attack)
        assert r.outcome is Outcome.WRONG and r.score == 0.0
        assert _accept_all(server) == 0


def test_parent_environment_is_hidden(verifier, uncontained, monkeypatch):
    """A secret in the verifier's environment reaches an unsandboxed child, not a sandboxed one."""
    secret = secrets.token_hex(8)
    monkeypatch.setenv("APRIEL_TEST_SECRET", secret)
    attack = solves_add_if(f"import os\nok = os.environ.get('APRIEL_TEST_SECRET') == {secret!r}")
    p = make_problem("code", ADD)
    assert run_verifier(uncontained, p, attack).success
    r = run_verifier(verifier, p, attack)
    assert r.outcome is Outcome.WRONG and r.score == 0.0


def test_parent_process_environ_is_unreadable(verifier, uncontained):
    """/proc/<verifier>/environ is readable by an unsandboxed child, not by the sandbox uid."""
    attack = solves_add_if("try:\n    ok = b'=' in open('/proc/%d/environ', 'rb').read()\n"
                           "except OSError:\n    ok = False" % os.getpid())
    p = make_problem("code", ADD)
    assert run_verifier(uncontained, p, attack).success
    r = run_verifier(verifier, p, attack)
    assert r.outcome is Outcome.WRONG and r.score == 0.0


def test_run_python_scrubbed_env_and_cleanup(fast):
    before = {n for n in os.listdir("/tmp") if n.startswith("apriel-sbx")}
    r = run_python("import os\nprint(sorted(os.environ))\nprint(os.getuid())", "", fast)
    env, uid = r.stdout.splitlines()
    assert set(eval(env)) <= {"PATH", "LANG", "HOME", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "OMP_NUM_THREADS"}
    assert int(uid) >= _UID_BASE
    assert {n for n in os.listdir("/tmp") if n.startswith("apriel-sbx")} == before


class _FakeFusion(BaseHTTPRequestHandler):
    """A stand-in SandboxFusion: 'runs' the known good program by adding the two stdin numbers."""

    def answer(self, body: dict) -> dict:
        if "SANDBOX_ERROR" in body["code"]:
            return {"status": "SandboxError", "message": "worker died"}
        if "while True" in body["code"]:
            return {"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "stdout": "", "stderr": "",
                                                        "return_code": None, "execution_time": 10.0}}
        a, b = map(int, body["stdin"].split())
        return {"status": "Success", "run_result": {"status": "Finished", "stdout": f"{a + b}\n", "stderr": "",
                                                     "return_code": 0, "execution_time": 0.01}}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/run_code" and body["language"] == "python"
        data = json.dumps(self.answer(body)).encode()
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
