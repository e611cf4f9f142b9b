"""Writing a small file so that a reader sees the old content or the new, never a part (a leaf)."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` atomically and durably: a hidden temporary file beside it
    (``.<name>.tmp-<pid>``, which readers ignore), fsync, rename, fsync of the directory. Atomic on a
    local disk and on NFS/Lustre; a writer killed midway leaves only the temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
