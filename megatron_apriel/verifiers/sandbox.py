"""Run untrusted Python in a throw-away sandbox process.

What is covered (Linux, parent running as root, the default `isolation="namespaces"`):
- a new session (process group), a private network namespace with no interfaces up (no network,
  not even the host's loopback), and a private mount namespace where /tmp, /var/tmp and /dev/shm
  are fresh tmpfs mounts that vanish with the sandbox;
- a unique unprivileged uid per run (0x40000000 + child pid): it cannot write outside its working
  directory (other paths are root-owned), cannot read `/proc/<parent>/environ`, and RLIMIT_NPROC
  applies to it alone, which stops fork bombs;
- RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE (output and file size), RLIMIT_NOFILE, no core dumps;
- a wall-clock timeout after which every process of the sandbox uid is killed, whatever process
  group it moved to; a scrubbed environment; a temporary working directory deleted afterwards.

What is not covered: the program can read world-readable files of the host (e.g. the Python
installation, /etc) and see host processes in /proc; there is no seccomp filter and no cgroup
(RLIMIT_AS bounds address space, not RSS, per process). Use the SandboxFusion backend
(`sandbox_fusion.py`) or a container for stronger isolation. `isolation="rlimits"` (for non-root
parents) keeps only the rlimits, the session and the scrubbed environment: no network or
filesystem isolation; it must be chosen explicitly.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from megatron_apriel.verifiers.config import SandboxConfig

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWIPC = 0x08000000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_BIND = 0x1000
_UID_BASE = 0x40000000
_PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass(frozen=True)
class RunResult:
    returncode: int | None
    """Exit status; negative = killed by that signal; None when the wall timeout fired."""
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float


def _mount(libc: ctypes.CDLL, source: bytes | None, target: bytes, fstype: bytes | None, flags: int,
           data: bytes | None) -> None:
    if libc.mount(source, target, fstype, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target!r}: {os.strerror(err)}")


def _enter_namespaces(config: SandboxConfig) -> None:
    """In the child, as root: private network, IPC and mount namespaces with fresh tmpfs dirs."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")
    _mount(libc, None, b"/", None, _MS_REC | _MS_PRIVATE, None)
    workdir = os.getcwd()  # Popen already chdir'ed here; the cwd survives the mounts below
    opts = f"size={config.tmpfs_mb}m,mode=1777".encode()
    for path in _PRIVATE_TMP:
        if os.path.isdir(path):
            _mount(libc, b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts)
    # The working directory lives under /tmp, now hidden: bind it back at the same path.
    os.makedirs(workdir, exist_ok=True)
    _mount(libc, b"/proc/self/cwd", workdir.encode(), None, _MS_BIND, None)
    os.chdir(workdir)


def _child_setup(config: SandboxConfig) -> None:
    """preexec_fn: runs in the child between fork and exec."""
    limits = {
        resource.RLIMIT_CPU: (config.cpu_time_s, config.cpu_time_s + 1),
        resource.RLIMIT_AS: (config.memory_mb << 20,) * 2,
        resource.RLIMIT_FSIZE: (config.max_output_bytes,) * 2,
        resource.RLIMIT_NOFILE: (config.max_open_files,) * 2,
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_NPROC: (config.max_processes,) * 2,
    }
    if config.isolation == "namespaces":
        _enter_namespaces(config)
        uid = _UID_BASE + os.getpid()
        os.chown(".", uid, uid)
        os.chmod(".", 0o700)
    for kind, value in limits.items():
        resource.setrlimit(kind, value)
    if config.isolation == "namespaces":
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def _kill_uid(uid: int) -> None:
    """SIGKILL every live (non-zombie) process of `uid` until none is left; a fork bomb races the first scans."""
    for _ in range(100):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                zombie = fields.get("State", "").split()[:1] == ["Z"]
                if not zombie and fields.get("Uid", "").split()[:1] == [str(uid)]:
                    found = True
                    os.kill(int(entry), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                continue  # the process exited while we looked
        if not found:
            return
        time.sleep(0.005)
    raise RuntimeError(f"could not kill all processes of sandbox uid {uid}")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole group has already exited


class LocalSandbox:
    """`run(code, stdin) -> RunResult` in a local sandbox process (see the module docstring)."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.config.check_host()

    def run(self, code: str, stdin: str = "") -> RunResult:
        return run_python(code, stdin, self.config)


def run_python(code: str, stdin: str, config: SandboxConfig) -> RunResult:
    """Run `code` as a Python script with `stdin`; return its exit status and (capped) output."""
    workdir = tempfile.mkdtemp(prefix="apriel-sbx-")
    iodir = tempfile.mkdtemp(prefix="apriel-sbx-io-")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        with open(os.path.join(iodir, "stdin"), "w") as f:
            f.write(stdin)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": ".",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        cmd = [config.python, "-I", "main.py"]
        with open(os.path.join(iodir, "stdin"), "rb") as fin, \
                open(os.path.join(iodir, "stdout"), "wb") as fout, \
                open(os.path.join(iodir, "stderr"), "wb") as ferr:
            start = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=fin, stdout=fout, stderr=ferr,
                                    start_new_session=True, preexec_fn=lambda: _child_setup(config))
            try:
                returncode: int | None = proc.wait(timeout=config.wall_timeout_s)
                # RLIMIT_CPU ends a busy loop with SIGXCPU, often before the wall clock does
                timed_out = returncode == -signal.SIGXCPU
            except subprocess.TimeoutExpired:
                returncode, timed_out = None, True
            wall = time.monotonic() - start
            _kill_group(proc.pid)
            if config.isolation == "namespaces":
                _kill_uid(_UID_BASE + proc.pid)
            proc.wait()
        return RunResult(returncode, _read_capped(os.path.join(iodir, "stdout"), config.max_output_bytes),
                         _read_capped(os.path.join(iodir, "stderr"), config.max_output_bytes), timed_out, wall)
    finally:
        shutil.rmtree(workdir)
        shutil.rmtree(iodir)


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")
