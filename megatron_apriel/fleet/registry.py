"""The vLLM fleet: its config, server discovery through the run directory, and local servers.

Discovery: ``apriel-serve --register-dir RUN_DIR/fleet`` writes ``<host>_<port>.json`` (a
`Registration`: URL and a fresh instance id) once its server answers ``/health``, wherever it
runs, so the trainer and the actor find the fleet without sharing a process tree with it (SLURM
places them on different nodes). A restarted server registers again under a new instance id,
which is how the trainer and the actor notice it needs the current weights.

Local servers (``apriel-eval``, tests, benchmarks; the launcher's are its components): each is a
``ManagedProcess``, so ``stop()`` ends vLLM's whole process tree (API server, engine core,
workers, also those that left its process group), never by name, and the servers die with the
process that started them, even one killed by SIGKILL.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import httpx

from megatron_apriel.files import atomic_write
from megatron_apriel.fleet.config import FleetConfig
from megatron_apriel.process import ManagedProcess
from megatron_apriel.records.base import Record
from megatron_apriel.run_dir import FLEET_DIR, RunDir  # noqa: F401  (FLEET_DIR: re-exported)


class Registration(Record):
    """One running server, as written into run_dir/fleet/ when it became healthy."""

    kind: str = "server_registration"
    url: str
    instance: str
    """New on every start: a changed instance at the same URL is a restarted server."""
    pid: int
    host: str


def register(fleet_dir: str | Path, url: str, pid: int, host: str) -> Registration:
    """Write (atomically) this server's registration; returns it."""
    reg = Registration(url=url.rstrip("/"), instance=uuid.uuid4().hex, pid=pid, host=host)
    fleet_dir = Path(fleet_dir)
    fleet_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(_registration_file(fleet_dir, reg.url), reg.model_dump_json())
    return reg


def _registration_file(fleet_dir: Path, url: str) -> Path:
    return fleet_dir / (url.split("://", 1)[-1].replace(":", "_").replace("/", "_") + ".json")


RETIRE_DIR = "retire"
"""``run_dir/fleet/retire/<instance>.txt``: a request that this server instance stop (its reason inside)."""


def retire(fleet_dir: str | Path, reg: Registration, reason: str) -> None:
    """Take a server out of the fleet: its registration goes (the actor and the weight sync stop
    using it) and its ``apriel-serve`` is asked to stop, which it does within a second or two; whoever
    started it restarts it as a crashed one (the local launcher, up to fleet.max_restarts), and it
    registers again as a new instance."""
    fleet_dir = Path(fleet_dir)
    _registration_file(fleet_dir, reg.url).unlink(missing_ok=True)
    (fleet_dir / RETIRE_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write(fleet_dir / RETIRE_DIR / f"{reg.instance}.txt", reason)


def retire_request(fleet_dir: str | Path, instance: str) -> Optional[str]:
    """The reason this instance was asked to stop, or None."""
    path = Path(fleet_dir) / RETIRE_DIR / f"{instance}.txt"
    return path.read_text() if path.exists() else None


def registered(fleet_dir: str | Path) -> list[Registration]:
    """Every registration in ``fleet_dir``, by URL."""
    fleet_dir = Path(fleet_dir)
    if not fleet_dir.is_dir():
        return []
    regs = [Registration.model_validate(json.loads(p.read_text())) for p in sorted(fleet_dir.glob("*.json"))]
    return sorted(regs, key=lambda r: r.url)


def wait_for_fleet(fleet_dir: str | Path, count: int, timeout_s: float, poll_s: float = 0.5,
                   give_up: Callable[[], bool] = lambda: False) -> list[Registration]:
    """Block until ``count`` servers registered (or ``give_up()``: those registered so far); a
    clear error after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while len(regs := registered(fleet_dir)) < count and not give_up():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(regs)} of {count} vLLM servers registered in {fleet_dir} after {timeout_s}s; "
                               "check their logs (run_dir/logs/server_*.log) or set fleet.servers.")
        time.sleep(poll_s)
    return regs


def fleet_urls(cfg: FleetConfig, run_dir: str | Path, timeout_s: Optional[float] = None) -> list[str]:
    """The fleet's URLs: ``cfg.servers``, or the registered servers once all have registered."""
    if cfg.servers:
        return [s.rstrip("/") for s in cfg.servers]
    regs = wait_for_fleet(RunDir(run_dir).fleet, cfg.num_servers, timeout_s or cfg.startup_timeout_s)
    return [r.url for r in regs]


@dataclass
class ServerProcess:
    """One ``apriel-serve`` started by us (``start_server``): a managed process (its own process
    group, dead with its owner, nothing it started left behind once stopped) and its URL."""

    url: str
    process: ManagedProcess

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.poll()}; log tail:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM server at {self.url} not healthy after {timeout_s}s; log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        return self.process.tail(n)

    def stop(self, grace_s: float = 20.0) -> None:
        self.process.stop(grace_s)


def serve_command(model_dir: str, port: int, host: str = "127.0.0.1", extra_args: Optional[list[str]] = None,
                  register_dir: Optional[str | Path] = None) -> list[str]:
    cmd = [sys.executable, "-m", "megatron_apriel.entrypoints.serve", "--model", str(model_dir), "--host", host,
           "--port", str(port)]
    if register_dir is not None:
        cmd += ["--register-dir", str(register_dir)]
    return cmd + list(extra_args or [])


def start_server(model_dir: str, port: int, log_path: str | Path, host: str = "127.0.0.1",
                 extra_args: Optional[list[str]] = None, env: Optional[dict] = None,
                 register_dir: Optional[str | Path] = None) -> ServerProcess:
    """Launch ``apriel-serve`` as a managed process (returns at once; call ``wait_healthy``)."""
    cmd = serve_command(model_dir, port, host, extra_args, register_dir)
    Path(log_path).unlink(missing_ok=True)
    process = ManagedProcess(f"server:{port}", cmd, Path(log_path), env or {})
    process.start()
    return ServerProcess(url=f"http://{host}:{port}", process=process)
