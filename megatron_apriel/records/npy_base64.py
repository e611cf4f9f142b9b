"""Base64 ``.npy`` read without decoding its payload: the header's shape and dtype, and whether the
text has the length of a header and a given payload. Routed experts travel in this form from vLLM
to the stream (``types.RoutedExperts``), and a record is validated on every read."""

from __future__ import annotations

import base64
import io
from typing import Optional

import numpy as np

_MAGIC = b"\x93NUMPY"


def _prefix(data: str, nbytes: int) -> bytes:
    """The first ``nbytes`` bytes of base64 ``data`` (decoding only the characters that hold them)."""
    return base64.b64decode(data[:4 * -(-nbytes // 3)])[:nbytes]


def _header_length(data: str) -> Optional[int]:
    """Bytes of the preamble and header (magic, version, length field, header dict), or None."""
    try:
        head = _prefix(data, 12)
    except ValueError:
        return None
    if len(head) < 12 or not head.startswith(_MAGIC):
        return None
    if head[6] == 1:
        return 10 + int.from_bytes(head[8:10], "little")
    return 12 + int.from_bytes(head[8:12], "little")


def holds(data: str, payload: int) -> bool:
    """Whether ``data`` is as long as the base64 of its header and ``payload`` bytes."""
    header = _header_length(data)
    if header is None:
        return False
    size = header + payload
    pad = -size % 3  # base64's trailing "="s
    return len(data) == 4 * -(-size // 3) and data.endswith("=" * pad) and not data.endswith("=" * (pad + 1))


def header(data: str) -> tuple[tuple[int, ...], np.dtype, bool]:
    """Shape, dtype and Fortran order from the header of base64 ``.npy`` ``data``."""
    length = _header_length(data)
    if length is None:
        raise ValueError("routed experts are not a base64 .npy (check the server's --return-routed-experts).")
    f = io.BytesIO(_prefix(data, length))
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(f)
    return tuple(int(n) for n in shape), dtype, fortran
