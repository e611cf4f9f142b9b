"""Bucket layout, packing, checksums and zero-copy unpacking (pure torch: no process groups).

A bucket is one flat byte buffer holding many tensors back to back, each at an offset aligned to
``ALIGN`` bytes so the slice can be viewed as its dtype without a copy. On the wire a bucket is
its payload followed by an 8-byte little-endian checksum of the payload (``with_trailer``), so a
receiver can check each bucket the moment it arrives.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

import torch

from megatron_apriel.weight_sync.protocol import BucketLayout, ChecksumAlgo, TensorSlot

ALIGN = 64
TRAILER = 8
DEFAULT_BUCKET_BYTES = 1 << 30
_WSUM_CHUNK = 1 << 20  # int32 words per block of the weighted sum
_MOD = (1 << 61) - 1

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"weight sync carries float32/bfloat16/float16 tensors, got {dtype}.")
    return _DTYPE_NAMES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[BucketLayout]:
    """Greedy, order-preserving layout: fill a bucket until the next tensor would overflow it.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. Works from names, dtypes and
    shapes only, so the plan can be made (and sent) before any tensor is gathered.
    """
    if bucket_bytes < ALIGN:
        raise ValueError(f"weight_sync.bucket_bytes must be >= {ALIGN}, got {bucket_bytes}.")
    buckets: list[BucketLayout] = []
    slots: list[TensorSlot] = []
    used = 0

    def close() -> None:
        nonlocal slots, used
        if slots:
            buckets.append(BucketLayout(index=len(buckets), nbytes=_aligned(used), tensors=slots))
        slots, used = [], 0

    for name, dtype, shape in tensors:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        offset = _aligned(used)
        if slots and offset + nbytes > bucket_bytes:
            close()
            offset = 0
        slots.append(TensorSlot(name=name, dtype=dtype_name(dtype), shape=list(shape), offset=offset, nbytes=nbytes))
        used = offset + nbytes
    close()
    return buckets


def new_wire_buffer(layout: BucketLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(layout.nbytes + TRAILER, dtype=torch.uint8, device=device)


def payload(wire: torch.Tensor) -> torch.Tensor:
    return wire[: wire.numel() - TRAILER]


def pack(layout: BucketLayout, tensors: Iterable[tuple[str, torch.Tensor]], wire: torch.Tensor) -> None:
    """Copy ``tensors`` (in layout order) into ``wire``'s payload; zero the alignment gaps."""
    body = payload(wire)
    end = 0
    for slot, (name, tensor) in zip(layout.tensors, tensors, strict=True):
        if name != slot.name or list(tensor.shape) != slot.shape or dtype_name(tensor.dtype) != slot.dtype:
            raise ValueError(
                f"bucket {layout.index}: got {name!r} {tuple(tensor.shape)} {tensor.dtype}, the plan says "
                f"{slot.name!r} {tuple(slot.shape)} {slot.dtype}; the sender's plan and data disagree."
            )
        if slot.offset > end:
            body[end : slot.offset].zero_()
        body[slot.offset : slot.offset + slot.nbytes].copy_(tensor.contiguous().view(-1).view(torch.uint8))
        end = slot.offset + slot.nbytes
    body[end:].zero_()


def unpack(layout: BucketLayout, wire: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of each tensor inside ``wire`` (no copy; they live as long as the buffer)."""
    body = payload(wire)
    for slot in layout.tensors:
        raw = body[slot.offset : slot.offset + slot.nbytes]
        yield slot.name, raw.view(torch_dtype(slot.dtype)).view(slot.shape)


def checksum(data: torch.Tensor, algo: ChecksumAlgo) -> int:
    """Checksum of a flat uint8 tensor whose length is a multiple of 4.

    crc32 reads host memory (zlib, ~4 GB/s on one core, releases the GIL). wsum64 stays on the
    tensor's device: int32 words summed per block of 2^20 words in int64 (exact), then the block
    sums are combined Fletcher-style, weighted by block position. Any single flipped bit changes
    either sum; moving data between blocks changes the weighted one.
    """
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() % 4:
        raise ValueError("checksum expects a flat uint8 tensor with a length divisible by 4.")
    if algo == "crc32":
        if data.device.type != "cpu":
            raise ValueError("crc32 checksums read host memory; use wsum64 for device buffers.")
        return zlib.crc32(data.numpy())
    words = data.view(torch.int32)
    n = words.numel()
    full = n // _WSUM_CHUNK * _WSUM_CHUNK
    sums = words[:full].view(-1, _WSUM_CHUNK).sum(1, dtype=torch.int64) if full else words.new_zeros(0, dtype=torch.int64)
    if full < n:
        sums = torch.cat([sums, words[full:].sum(dtype=torch.int64).view(1)])
    a = b = 0
    for i, s in enumerate(sums.tolist()):
        a = (a + s) % _MOD
        b = (b + (i + 1) * s) % _MOD
    return (a ^ (b << 3)) & ((1 << 64) - 1)


def seal(wire: torch.Tensor, algo: ChecksumAlgo) -> int:
    """Write the payload's checksum into the trailer; returns it."""
    value = checksum(payload(wire), algo)
    trailer = torch.tensor(list(value.to_bytes(TRAILER, "little")), dtype=torch.uint8)
    wire[-TRAILER:].copy_(trailer)
    return value


def verify(wire: torch.Tensor, algo: ChecksumAlgo) -> tuple[bool, int, int]:
    """(ok, expected from the trailer, computed over the payload)."""
    expected = int.from_bytes(bytes(wire[-TRAILER:].cpu().tolist()), "little")
    actual = checksum(payload(wire), algo)
    return expected == actual, expected, actual
