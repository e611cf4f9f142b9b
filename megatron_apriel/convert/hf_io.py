"""Reading and writing Hugging Face safetensors checkpoints, one tensor at a time.

:class:`HFReader` validates a checkpoint before any tensor is read: the index names files that
exist, every file's header parses and the file is as long as its header says (a truncated
download is caught here, naming the file). :class:`ShardedWriter` writes tensors into
``model-0000i-of-0000N.safetensors`` shards of bounded size plus ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
SINGLE = "model.safetensors"


def read_header(path: Path) -> dict:
    """The safetensors header of ``path`` (name -> {dtype, shape, data_offsets}), checked for length."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is truncated ({size} bytes): download or copy it again.")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise ValueError(f"{path} is truncated (header needs {header_len} bytes, file has {size}): "
                             "download or copy it again.")
        try:
            header = json.loads(f.read(header_len))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} has a corrupt safetensors header ({e}): download or copy it again.") from e
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + header_len + end > size:
        raise ValueError(f"{path} is truncated: its tensors need {8 + header_len + end} bytes but the file has "
                         f"{size}. Download or copy it again.")
    return header


def data_start(path: Path) -> int:
    """File offset that a safetensors file's ``data_offsets`` count from (after the header)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


class HFReader:
    """The tensors of one HF model directory (single file or sharded with an index)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{config_file} not found: --hf must be a Hugging Face model directory.")
        self.config = json.loads(config_file.read_text())
        self.files = self._weight_files()
        self.headers = {name: read_header(self.path / name) for name in sorted(set(self.files.values()))}
        for key, name in self.files.items():
            if key not in self.headers[name]:
                raise ValueError(f"{INDEX} says {key!r} is in {name}, but that file does not hold it: "
                                 "the index and the shards come from different downloads.")
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        self._maps: dict[str, mmap.mmap] = {}

    def _weight_files(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise ValueError(f"{index} lists shard files that are missing: {missing}. Download them again.")
            return dict(weight_map)
        if (self.path / SINGLE).is_file():
            return {k: SINGLE for k in read_header(self.path / SINGLE)}
        raise ValueError(f"no {INDEX} or {SINGLE} in {self.path}; only safetensors checkpoints are supported "
                         "(convert .bin weights with transformers' save_pretrained(safe_serialization=True)).")

    def keys(self) -> list[str]:
        return list(self.files)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.headers[self.files[key]][key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPES[self.headers[self.files[key]][key]["dtype"]]

    def nbytes(self, key: str) -> int:
        start, end = self.headers[self.files[key]][key]["data_offsets"]
        return end - start

    def get(self, key: str) -> torch.Tensor:
        if key not in self.files:
            raise ValueError(f"tensor {key!r} is missing from {self.path}: the checkpoint is incomplete or its "
                             "config.json describes another model.")
        name = self.files[key]
        if name not in self._handles:
            self._handles[name] = self._stack.enter_context(safe_open(self.path / name, framework="pt"))
        return self._handles[name].get_tensor(key)

    def map_rows(self, key: str, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of tensor ``key`` as a tensor over the file's mapped bytes: no copy,
        no page read until the data is, and a storage of exactly those rows (so writers that clone
        views, e.g. Megatron's, do not copy it). Read-only by contract: writes stay private."""
        if key not in self.files:
            raise ValueError(f"tensor {key!r} is missing from {self.path}: the checkpoint is incomplete or its "
                             "config.json describes another model.")
        name = self.files[key]
        meta, shape = self.headers[name][key], self.shape(key)
        assert 0 <= start < end <= shape[0], (key, shape, start, end)
        row = math.prod(shape[1:])
        dtype = self.dtype(key)
        if name not in self._maps:
            with open(self.path / name, "rb") as f:
                self._maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        offset = data_start(self.path / name) + meta["data_offsets"][0] + start * row * dtype.itemsize
        flat = torch.frombuffer(self._maps[name], dtype=dtype, count=(end - start) * row, offset=offset)
        return flat.view(end - start, *shape[1:])

    def close(self) -> None:
        """Unmap every open shard (reading again reopens them). Tensors from :meth:`map_rows` keep
        their file mapped until they are freed."""
        self._stack.close()
        self._stack = ExitStack()
        self._handles.clear()
        self._maps.clear()

    def __enter__(self) -> "HFReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardedWriter:
    """Accumulate tensors and write them as safetensors shards of at most ``max_shard_bytes``
    (a larger single tensor gets a shard of its own). ``finish()`` names the shards and writes the index."""

    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        assert name not in self._pending, name
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        save_file(self._pending, self.out_dir / f"shard-{len(self._shards):05d}.tmp", metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out_dir / f"shard-{i:05d}.tmp").rename(self.out_dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
