"""Rendezvous helpers for one machine: a free port, and a one-rank world for tools that need
torch.distributed without a launcher (conversion, single-process checks)."""

from __future__ import annotations

import os
import random
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LISTEN_PORTS = (20000, 32767)
"""Where `free_port` draws from when the ephemeral range is 32768 and up (Linux's default)."""


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for outgoing connections and bind(0)."""
    try:
        low, high = (int(x) for x in _EPHEMERAL.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default; what a machine without /proc would use


def free_port(rng: Optional[random.Random] = None) -> int:
    """A TCP port that is free now on 127.0.0.1, for a server that binds it a moment later.

    Drawn at random below the ephemeral range: a port from that range (bind(0)) can be taken in
    between by any outgoing connection's local port (an HTTP client's, say), which here come by the
    thousand; below it only another explicit bind can take it, and two runs drawing the same port
    of 12,768 at the same moment is unlikely (a port that is busy now is drawn again)."""
    rng = rng or random.SystemRandom()
    low, high = _LISTEN_PORTS
    below = ephemeral_range()[0] > high  # else an unusual ephemeral range: take the kernel's choice
    for _ in range(64):
        port = rng.randint(low, high) if below else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free TCP port found in {low}-{high} on 127.0.0.1 after 64 draws")


@contextmanager
def single_process_world(backend: str = "gloo") -> Iterator[object]:
    """A one-rank world with Megatron's groups (yields the ParallelContext); restores the env."""
    from megatron_apriel.parallel import ParallelConfig, destroy_parallel, init_parallel

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("this tool runs as a single process; launch it without torchrun/srun.")
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    try:
        ctx = init_parallel(ParallelConfig(backend=backend))
        try:
            yield ctx
        finally:
            destroy_parallel()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
