"""Settings of the trainer -> fleet weight broadcast (``weight_sync.*``). A leaf: standard library only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

ALIGN = 64
"""Byte alignment of each tensor in a packed bucket."""
DEFAULT_BUCKET_BYTES = 1 << 30
DEFAULT_DIRECT_BYTES = 8 << 20
"""Tensors this large go on the wire from their own memory. Below it, a broadcast of its own costs
more than copying the tensor into a packed bucket. Here (gloo over loopback, 2 cores) a broadcast
costs ~0.4-0.7 ms beyond its bytes and a copy runs at ~6 GB/s, so the crossover is a few MB;
``benchmarks/weight_sync.py --direct-mb 2 4 8 16`` measures it. On GPUs both are small next to
the link (a 8 MiB device copy takes ~5 us, about one NCCL launch)."""


@dataclass(kw_only=True)
class WeightSyncConfig:
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Packed bucket size; two packing buffers per stage sender."""
    direct_bytes: int = DEFAULT_DIRECT_BYTES
    """Tensors at least this large are sent from their own memory (or their TP gather's output),
    without a packing copy; smaller ones are packed."""
    backend: str = "auto"
    """auto (nccl with CUDA, gloo without), nccl or gloo. Must match the servers' engine."""
    advertise_host: Optional[str] = None
    """Address the servers reach this rank at; null: this host's name."""
    base_port: int = 0
    """0: each stage's sender binds a free port when it (re)connects and tells the servers which, so
    two runs on one node never collide; N: stage s listens on N + s (a firewall that opens a fixed
    range; one run per node then)."""
    timeout_s: float = 600.0
    checksum: str = "sum64"
    """Per-bucket checksum: sum64 (cheap, any device) or crc32 (stronger, CPU only)."""
    push_attempts: int = 3
    """Tries per update: a server that dies mid-update fails it; the fleet is joined again without
    it (or with its restarted self) and the update sent again."""

    def stage_port(self, stage: int) -> int:
        """The port stage ``stage``'s sender binds (0: a free one, chosen by the bind)."""
        return self.base_port + stage if self.base_port else 0

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"weight_sync.backend must be auto, nccl or gloo, got {self.backend!r}.")
        if self.checksum not in ("sum64", "crc32"):
            raise ValueError(f"weight_sync.checksum must be sum64 or crc32, got {self.checksum!r}.")
        if self.push_attempts < 1:
            raise ValueError(f"weight_sync.push_attempts must be >= 1, got {self.push_attempts}.")
        if self.bucket_bytes < ALIGN:
            raise ValueError(f"weight_sync.bucket_bytes must be >= {ALIGN}, got {self.bucket_bytes}.")
        if not 0 <= self.base_port < 65536:
            raise ValueError(f"weight_sync.base_port={self.base_port} is not a port; use 0 for free ones.")
        if self.direct_bytes < 1:
            raise ValueError(f"weight_sync.direct_bytes must be >= 1, got {self.direct_bytes}.")
