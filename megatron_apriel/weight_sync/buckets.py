"""Bucket layout, packing, checksums and zero-copy unpacking (pure torch: no process groups).

Two kinds of bucket go on the wire, in plan order:
- packed: one flat byte buffer holding small tensors back to back, each at an offset aligned to
  ``ALIGN`` bytes so the slice can be viewed as its dtype without a copy;
- direct: one tensor of at least ``direct_bytes``, sent from its own memory (the parameter, or
  the TP gather's output): no packing copy.
Every bucket's checksum (over its exact bytes) goes into the stage's checksum table, sent after
the last bucket; the receiver checks each bucket as it arrives and compares with the table.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Optional

import numpy as np
import torch

from megatron_apriel.records.weights import BucketLayout, ChecksumAlgo, TensorSlot
from megatron_apriel.weight_sync.config import ALIGN

_SUM_BLOCK = 1 << 17  # 64-bit words per block of sum64
BLOCK_BYTES = _SUM_BLOCK * 8  # 1 MiB: sum64's block
STEP = 1 << 19  # the fused packer copies then checksums 512 KiB at a time (src + dst fit in L2)
_MASK = (1 << 64) - 1

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


def _nbytes(dtype: torch.dtype, shape) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty((), dtype=dtype).element_size()


def plan_buckets(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int,
                 direct_bytes: Optional[int] = None) -> list[BucketLayout]:
    """Order-preserving layout, in send order. A tensor of at least ``direct_bytes`` (default: never)
    is a direct bucket of its own; the others fill packed buckets greedily (one larger than
    ``bucket_bytes`` gets a packed bucket of its own). A bucket is sent as soon as its last
    tensor is drawn, so buckets are ordered by their last tensor's position in ``tensors``.

    Works from names, dtypes and shapes only, so the plan can be made (and sent) before any
    tensor is gathered.
    """
    if bucket_bytes < ALIGN:
        raise ValueError(f"weight_sync.bucket_bytes must be >= {ALIGN}, got {bucket_bytes}.")
    if direct_bytes is not None and direct_bytes < 1:
        raise ValueError(f"weight_sync.direct_bytes must be >= 1, got {direct_bytes}.")
    done: list[tuple[int, bool, int, list[TensorSlot]]] = []  # (last tensor's position, direct, nbytes, slots)
    slots: list[TensorSlot] = []
    used = last = 0

    def close() -> None:
        nonlocal slots, used
        if slots:
            done.append((last, False, _aligned(used), slots))
        slots, used = [], 0

    for i, (name, dtype, shape) in enumerate(tensors):
        nbytes = _nbytes(dtype, shape)
        if direct_bytes is not None and nbytes >= direct_bytes:
            done.append((i, True, nbytes, [TensorSlot(name=name, dtype=dtype_name(dtype), shape=list(shape),
                                                      offset=0, nbytes=nbytes)]))
            continue
        offset = _aligned(used)
        if slots and offset + nbytes > bucket_bytes:
            close()
            offset = 0
        slots.append(TensorSlot(name=name, dtype=dtype_name(dtype), shape=list(shape), offset=offset, nbytes=nbytes))
        used, last = offset + nbytes, i
    close()
    done.sort(key=lambda d: d[0])
    return [BucketLayout(index=k, nbytes=n, direct=direct, tensors=ts) for k, (_, direct, n, ts) in enumerate(done)]


def new_wire_buffer(layout: BucketLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.empty(layout.nbytes, dtype=torch.uint8, device=device)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("as_bytes views a tensor's own memory; this one is not contiguous (copy it first).")
    return tensor.detach().view(-1).view(torch.uint8)


def direct_bytes_of(layout: BucketLayout, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What goes on the wire for a direct bucket: the tensor's own memory (a copy only if it is
    not contiguous, e.g. a transposed view)."""
    _check_slot(layout, layout.tensors[0], name, tensor)
    return as_bytes(tensor if tensor.is_contiguous() else tensor.contiguous())


def _check_slot(layout: BucketLayout, slot: TensorSlot, name: str, tensor: torch.Tensor) -> None:
    if name != slot.name or list(tensor.shape) != slot.shape or dtype_name(tensor.dtype) != slot.dtype:
        raise ValueError(
            f"bucket {layout.index}: got {name!r} {tuple(tensor.shape)} {tensor.dtype}, the plan says "
            f"{slot.name!r} {tuple(slot.shape)} {slot.dtype}; the sender's plan and data disagree."
        )


class _BlockChecksum:
    """Checksums a host payload ``STEP`` bytes at a time, each step as soon as it has been written
    (so it is read back from cache, not from memory). Gives the same value as ``checksum``."""

    def __init__(self, body: torch.Tensor, algo: ChecksumAlgo):
        self.algo, self.size, self.done = algo, body.numel(), 0
        self.bytes = body.numpy()
        self.words = self.bytes.view(np.uint64)
        self.sums: list[int] = []
        self.block = 0  # running sum of the current sum64 block
        self.crc = 0

    def advance(self, written: int) -> None:
        """Bytes ``[0, written)`` are final: checksum every whole step inside them not yet done."""
        while self.done < written:
            stop = min(self.done + STEP, self.size)
            if stop > written:
                return
            if self.algo == "crc32":
                self.crc = zlib.crc32(self.bytes[self.done : stop], self.crc)
            else:
                self.block += int(self.words[self.done // 8 : stop // 8].sum(dtype=np.uint64))
                if stop % BLOCK_BYTES == 0 or stop == self.size:
                    self.sums.append(self.block & _MASK)
                    self.block = 0
            self.done = stop

    def value(self) -> int:
        if self.done != self.size:
            raise RuntimeError(f"checksummed {self.done} of {self.size} payload bytes; the packer skipped some.")
        return self.crc if self.algo == "crc32" else _combine(self.sums)


class _NoChecksum:
    def advance(self, written: int) -> None:
        pass


def _copy_in(body: torch.Tensor, offset: int, tensor: torch.Tensor, sums) -> None:
    """One pass from ``tensor`` (any strides) into ``body[offset:]``, ``STEP`` bytes at a time."""
    nbytes = tensor.numel() * tensor.element_size()
    if body.device.type != "cpu" or tensor.device.type != "cpu":  # one kernel; the checksum comes after
        body[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        sums.advance(offset + nbytes)
        return
    if not tensor.is_contiguous():
        _copy_rows(body, offset, tensor, sums)
        return
    src = as_bytes(tensor)
    dst_np, src_np = body.numpy(), src.numpy()  # numpy: ~3x less per-call overhead than torch
    pos, n = 0, src.numel()
    while pos < n:
        at = offset + pos
        step = min(n - pos, STEP - at % STEP)
        np.copyto(dst_np[at : at + step], src_np[pos : pos + step])
        pos += step
        sums.advance(at + step)


def _copy_rows(body: torch.Tensor, offset: int, tensor: torch.Tensor, sums) -> None:
    """Non-contiguous source (a transpose, a strided split): copy rows with their strides, no
    temporary contiguous copy."""
    dst = body[offset : offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
    row = tensor[0].numel() * tensor.element_size()
    rows = max(1, STEP // max(row, 1))
    for i in range(0, tensor.shape[0], rows):
        dst[i : i + rows].copy_(tensor[i : i + rows])
        sums.advance(offset + min(i + rows, tensor.shape[0]) * row)


def _zero(body: torch.Tensor, start: int, stop: int, sums) -> None:
    if stop > start:
        body[start:stop].zero_()
    sums.advance(stop)


class BucketPacker:
    """Fills one packed bucket tensor by tensor, in layout order, checksumming each step of the
    copy as it is written (host buffers); a device buffer is checksummed on the device at the end."""

    def __init__(self, layout: BucketLayout, wire: torch.Tensor, algo: Optional[ChecksumAlgo]):
        self.layout, self.wire, self.algo = layout, wire, algo
        self.on_host = wire.device.type == "cpu"
        self.sums = _BlockChecksum(wire, algo) if algo and self.on_host else _NoChecksum()
        self.count = self.end = 0

    @property
    def full(self) -> bool:
        return self.count == len(self.layout.tensors)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.full:
            raise ValueError(f"bucket {self.layout.index} is full, got {name!r}; the sender's plan and data disagree.")
        slot = self.layout.tensors[self.count]
        _check_slot(self.layout, slot, name, tensor)
        _zero(self.wire, self.end, slot.offset, self.sums)
        _copy_in(self.wire, slot.offset, tensor, self.sums)
        self.end, self.count = slot.offset + slot.nbytes, self.count + 1

    def finish(self):
        """Zero the tail; the checksum (an int on host, a 0-dim device tensor on a device), or None."""
        if not self.full:
            raise ValueError(f"bucket {self.layout.index} got {self.count} of {len(self.layout.tensors)} tensors.")
        _zero(self.wire, self.end, self.wire.numel(), self.sums)
        if self.algo is None:
            return None
        return self.sums.value() if self.on_host else checksum_on_device(self.wire)


def _pack(layout: BucketLayout, tensors: Iterable[tuple[str, torch.Tensor]], wire: torch.Tensor,
          algo: Optional[ChecksumAlgo]):
    packer = BucketPacker(layout, wire, algo)
    for name, tensor in tensors:
        packer.add(name, tensor)
    return packer.finish()


def pack(layout: BucketLayout, tensors: Iterable[tuple[str, torch.Tensor]], wire: torch.Tensor) -> None:
    """Copy ``tensors`` (in layout order) into the packed bucket ``wire``; zero the alignment gaps."""
    _pack(layout, tensors, wire, None)


def pack_summed(layout: BucketLayout, tensors: Iterable[tuple[str, torch.Tensor]], wire: torch.Tensor,
                algo: ChecksumAlgo) -> int:
    """``pack`` and ``checksum`` in one pass over memory: on host buffers each step is checksummed
    right after it is written (from cache). Device buffers: pack, then checksum on the device."""
    value = _pack(layout, tensors, wire, algo)
    return value if isinstance(value, int) else int(value) & _MASK


def unpack(layout: BucketLayout, wire: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of each tensor inside ``wire`` (no copy; they live as long as the buffer)."""
    for slot in layout.tensors:
        raw = wire[slot.offset : slot.offset + slot.nbytes]
        yield slot.name, raw.view(torch_dtype(slot.dtype)).view(slot.shape)


def checksum(data: torch.Tensor, algo: ChecksumAlgo) -> int:
    """Checksum of a flat uint8 tensor (any length; a partial last word counts as zero-padded).

    sum64 (default): the bytes as 64-bit words, summed (wrapping) per block of 2^17 words,
    block sums combined Fletcher-style weighted by block position. numpy on host buffers (~15 GB/s
    on one core here, GIL released), torch on device buffers (no copy to the host); both give
    the same value. Any single flipped bit changes it; so does moving data between blocks.
    crc32: zlib over host bytes; stronger, several times slower.
    """
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("checksum expects a flat uint8 tensor.")
    if algo == "crc32":
        if data.device.type != "cpu":
            raise ValueError("crc32 checksums read host memory; use sum64 for device buffers.")
        return zlib.crc32(data.numpy())
    if data.device.type != "cpu":
        return int(checksum_on_device(data)) & _MASK
    return _combine(_numpy_sums(data))


def _tail_word(tail: torch.Tensor) -> int:
    """The last partial word (< 8 bytes), zero-padded, as the little-endian integer it reads as."""
    return int.from_bytes(bytes(tail.cpu().numpy()) + bytes(8 - tail.numel()), "little")


def _numpy_sums(data: torch.Tensor) -> list[int]:
    n8 = data.numel() // 8 * 8
    words = data[:n8].numpy().view(np.uint64)
    full = words.size // _SUM_BLOCK * _SUM_BLOCK
    sums = words[:full].reshape(-1, _SUM_BLOCK).sum(axis=1, dtype=np.uint64).tolist()
    rest = int(words[full:].sum(dtype=np.uint64)) if full < words.size else None
    if n8 < data.numel():
        rest = ((rest or 0) + _tail_word(data[n8:])) & _MASK
    return sums + ([rest] if rest is not None else [])


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def checksum_on_device(data: torch.Tensor) -> torch.Tensor:
    """sum64 computed where ``data`` lives, as a 0-dim int64 tensor there (its bits are the
    checksum): no host round trip, so a GPU sender and receiver never wait on the host for it.
    Wrapping int64 arithmetic has the same bits as the uint64 arithmetic of ``checksum``."""
    n8 = data.numel() // 8 * 8
    words = data[:n8].view(torch.int64)
    full = words.numel() // _SUM_BLOCK * _SUM_BLOCK
    parts = [words[:full].view(-1, _SUM_BLOCK).sum(1)] if full else []
    if full < words.numel() or n8 < data.numel():
        rest = words[full:].sum().view(1)
        if n8 < data.numel():
            rest = rest + _signed(_tail_word(data[n8:]))
        parts.append(rest)
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=data.device)
    sums = torch.cat(parts)
    a = sums.sum()
    b = (sums * torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=data.device)).sum()
    rotated = torch.bitwise_or(torch.bitwise_left_shift(b, 32), torch.bitwise_and(torch.bitwise_right_shift(b, 32),
                                                                                  0xFFFFFFFF))
    return torch.bitwise_xor(a, rotated)


def _combine(sums: list[int]) -> int:
    a = b = 0
    for i, s in enumerate(sums):
        a = (a + s) & _MASK
        b = (b + (i + 1) * s) & _MASK
    return a ^ (((b << 32) | (b >> 32)) & _MASK)


def checksum_table(values: list) -> torch.Tensor:
    """Per-bucket checksums (ints, or 0-dim int64 device tensors) as one int64 tensor to broadcast."""
    if values and isinstance(values[0], torch.Tensor):
        return torch.stack(values)
    return torch.tensor([_signed(v) for v in values], dtype=torch.int64)


def table_values(table: torch.Tensor) -> list[int]:
    return [v & _MASK for v in table.cpu().tolist()]
