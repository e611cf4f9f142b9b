"""Rendezvous helpers for one machine: a free port, and a one-rank world for tools that need
torch.distributed without a launcher (conversion, single-process checks)."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from typing import Iterator

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the rendezvous binds it right away)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
