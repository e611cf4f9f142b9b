"""Start, health-check and stop ``apriel-serve`` processes (one per port) on this machine.

Each server runs in its own session, so ``stop()`` ends vLLM's whole process tree (API server,
engine core, workers) with one signal to its process group, never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log_path: Path

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode}; log tail:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server at {self.url} not healthy after {timeout_s}s; log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-n:])

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait(grace_s)


def start_server(model_dir: str, port: int, log_path: str | Path, host: str = "127.0.0.1",
                 extra_args: Optional[list[str]] = None, env: Optional[dict] = None) -> ServerProcess:
    """Launch ``apriel-serve`` in a new session (returns at once; call ``wait_healthy``)."""
    cmd = [sys.executable, "-m", "megatron_apriel.entrypoints.serve", "--model", str(model_dir), "--host", host,
           "--port", str(port), *(extra_args or [])]
    log_path = Path(log_path)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    return ServerProcess(url=f"http://{host}:{port}", process=proc, log_path=log_path)
