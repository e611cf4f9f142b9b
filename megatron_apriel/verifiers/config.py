"""Settings of the verifiers (``actor.verifiers.*``): math-verify's limits, the code sandbox's limits
and the SandboxFusion server. A leaf: standard library only. Checks that depend on the machine
(root for the namespace sandbox, the candidate interpreter) run where the sandbox is built, in the
verifier process, not here: a trainer node reads these settings too."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class MathVerifierConfig:
    timeout_s: int = 1
    """Seconds allowed to parse, and then to compare, one answer (math-verify timers; whole seconds)."""

    max_answer_chars: int = 1000
    """A boxed answer longer than this is unparsable (guards the sympy parser)."""

    def __post_init__(self) -> None:
        if self.timeout_s < 1 or self.max_answer_chars < 1:
            raise ValueError("timeout_s and max_answer_chars must be >= 1.")


@dataclass(kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed run."""

    wall_timeout_s: float = 10.0
    """Wall-clock limit per run (the recipe gives 10 s per test)."""

    cpu_time_s: int = 10
    """RLIMIT_CPU in seconds: CPU time of each process."""

    memory_mb: int = 1024
    """RLIMIT_AS in MiB: address space of each process."""

    max_processes: int = 16
    """RLIMIT_NPROC: processes and threads the sandbox uid may own at once."""

    max_output_bytes: int = 4 << 20
    """RLIMIT_FSIZE: the largest file (stdout and stderr are files) a sandbox process may write."""

    max_open_files: int = 128
    """RLIMIT_NOFILE."""

    tmpfs_mb: int = 64
    """Size of each private tmpfs (/tmp, /var/tmp, /dev/shm) inside the sandbox."""

    isolation: str = "namespaces"
    """'namespaces' needs root (see module docstring); 'rlimits' is the weaker non-root fallback."""

    python: str = "/usr/bin/python3"
    """Interpreter for the candidate; it must be executable by an unprivileged uid (a virtualenv
    under /root is not), so the system Python by default: candidates get the standard library."""

    def __post_init__(self) -> None:
        if self.wall_timeout_s <= 0 or self.cpu_time_s < 1 or self.memory_mb < 64:
            raise ValueError("need wall_timeout_s > 0, cpu_time_s >= 1 and memory_mb >= 64.")
        if self.max_processes < 1 or self.max_output_bytes < 1024 or self.max_open_files < 16:
            raise ValueError("need max_processes >= 1, max_output_bytes >= 1024, max_open_files >= 16.")
        if self.isolation not in ("namespaces", "rlimits"):
            raise ValueError(f"isolation={self.isolation!r}: use 'namespaces' (root) or 'rlimits'.")

    def check_host(self) -> None:
        """What this machine must offer to run the sandbox (called where it is built)."""
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"python={self.python!r} is not an executable; point it at a Python "
                             "interpreter that every user may run, e.g. /usr/bin/python3.")
        if self.isolation == "namespaces" and os.geteuid() != 0:
            raise ValueError("isolation='namespaces' needs the verifier to run as root: run it as root, use "
                             "SandboxFusion (actor.verifiers.code.backend=sandbox_fusion), or accept "
                             "actor.verifiers.code.sandbox.isolation=rlimits (no network or filesystem isolation).")


@dataclass(kw_only=True)
class SandboxFusionConfig:
    url: str = "http://localhost:8080"
    """Base URL of the SandboxFusion server."""

    run_timeout_s: float = 10.0
    """Per-run time limit the server enforces."""

    memory_mb: int = 1024
    """Per-run memory limit the server enforces."""

    http_timeout_s: float = 60.0
    """Client-side limit for one HTTP exchange (queueing included)."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url={self.url!r}: give an http(s) base URL, e.g. http://host:8080.")
        if self.run_timeout_s <= 0 or self.http_timeout_s <= self.run_timeout_s:
            raise ValueError("need run_timeout_s > 0 and http_timeout_s > run_timeout_s.")


@dataclass(kw_only=True)
class CodeVerifierConfig:
    backend: str = "local"
    """'local': subprocess sandbox on this machine; 'sandbox_fusion': a SandboxFusion server."""

    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Local sandbox limits (backend = 'local')."""

    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    """Remote server settings, used when backend = 'sandbox_fusion'."""

    def __post_init__(self) -> None:
        if self.backend not in ("local", "sandbox_fusion"):
            raise ValueError(f"backend={self.backend!r}: use 'local' or 'sandbox_fusion'.")


@dataclass(kw_only=True)
class VerifiersConfig:
    """The verifiers' settings, one block per configurable domain (``actor.verifiers.math.timeout_s``,
    ``actor.verifiers.code.sandbox.memory_mb``, ``actor.verifiers.code.backend=sandbox_fusion``...)."""

    math: MathVerifierConfig = field(default_factory=MathVerifierConfig)
    code: CodeVerifierConfig = field(default_factory=CodeVerifierConfig)
