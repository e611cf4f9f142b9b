"""HF safetensors <-> Megatron distributed checkpoint, streamed one decoder layer at a time.

``hf_to_mcore``: describe every canonical tensor as row ranges of the HF tensors (the table's
transforms only concatenate rows), map those ranges from the safetensors files without reading
them, and let Megatron's writer store each range as its own chunk of the global tensor. Nothing
is copied into the process: the bytes go from the (page-cached) HF files to the .distcp files
once, and resident memory does not grow with the model. ``mcore_to_hf``: read one layer's global
tensors from the dist checkpoint (whatever TP/PP saved it), map them back and append them to
size-bounded safetensors shards. Both write into a hidden ``.NAME.partial-PID`` directory next
to ``--out`` and rename it into place only when complete; on any error it is removed.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch
from tqdm import tqdm

from megatron_apriel.convert import mcore_io
from megatron_apriel.convert.hf_config import copy_support_files, hf_config_from_arch
from megatron_apriel.convert.hf_io import HFReader, ShardedWriter
from megatron_apriel.convert.mapping import (
    LAYOUTS,
    HFLayout,
    canonical_row_pieces,
    canonical_to_hf,
    detect_layout,
    expected_hf_shapes,
    megatron_names,
)
from megatron_apriel.model.arch import ModelArch
from megatron_apriel.model.provider import padded_vocab_size
from megatron_apriel.parallel.dims import ParallelDims
from megatron_apriel.parallel.rendezvous import single_process_world

FORMAT_VERSION = 1
MODEL_METADATA = "apriel_model.json"
"""Written next to the dist checkpoint: format version, architecture, source. Trainer checkpoints
should write it too (:func:`write_model_metadata`) so mcore-to-hf needs no reference."""
_VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


@contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """A fresh hidden directory next to ``out``, renamed to ``out`` on success, removed on failure."""
    if out.exists():
        raise ValueError(f"{out} already exists; remove it or choose another --out.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.rename(tmp, out)


def write_model_metadata(ckpt_dir: Path, arch: ModelArch, source: dict) -> None:
    meta = {"format_version": FORMAT_VERSION, "arch": arch.to_dict(), "source": source}
    (Path(ckpt_dir) / MODEL_METADATA).write_text(json.dumps(meta, indent=2) + "\n")


def read_model_metadata(ckpt_dir: Path) -> Optional[dict]:
    path = Path(ckpt_dir) / MODEL_METADATA
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {meta.get('format_version')}; this apriel-convert reads "
                         f"version {FORMAT_VERSION}. Use the megatron_apriel version that wrote it.")
    return meta


def check_text_tensors(reader: HFReader, arch: ModelArch, layout: HFLayout) -> None:
    """Every tensor the table expects is present with the shape config.json implies, and no text
    tensor is left unmapped. Raises ValueError naming the tensor (and file) otherwise."""
    expected = {}
    for layer in mcore_io.iter_layers(arch):
        expected.update(expected_hf_shapes(arch, layer))
    present = {layout.to_plain(k): k for k in reader.keys() if layout.to_plain(k) is not None}
    missing = sorted(set(expected) - set(present))
    if missing:
        raise ValueError(f"{reader.path} lacks {len(missing)} tensor(s) the config implies, e.g. "
                         f"{[layout.to_checkpoint(m) for m in missing[:3]]}: the checkpoint is incomplete, or "
                         "config.json (num_hidden_layers, tie_word_embeddings, ...) describes another model.")
    unmapped = sorted(set(present) - set(expected))
    if unmapped:
        raise ValueError(f"{reader.path} holds text-decoder tensors the {arch.family} table does not map, e.g. "
                         f"{[present[u] for u in unmapped[:3]]}: this variant (biases, extra norms) is not "
                         "supported, or config.json does not match the weights.")
    for plain, shape in expected.items():
        key = present[plain]
        if reader.shape(key) != shape:
            raise ValueError(f"{key} in {reader.files[key]} has shape {reader.shape(key)} but config.json implies "
                             f"{shape}: config.json does not match the weights.")


def _mapped_pieces(reader: HFReader, layout: HFLayout, arch: ModelArch,
                   layer: Optional[int]) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Canonical name -> ``(first_row, tensor mapped from the HF file)`` pieces, for one layer."""
    out = {}
    for name, ranges in canonical_row_pieces(arch, layer).items():
        row, parts = 0, []
        for plain, start, end in ranges:
            parts.append((row, reader.map_rows(layout.to_checkpoint(plain), start, end)))
            row += end - start
        out[name] = parts
    return out


def hf_to_mcore(hf: str | Path, out: str | Path, tp: int = 1, pp: int = 1, progress: bool = True,
                ep: int = 1) -> None:
    """Convert an HF checkpoint's text decoder into a Megatron dist checkpoint at ``out``.

    ``tp``/``pp``/``ep`` are checked against the model (heads, layers, experts) and ``tp`` sets the
    vocabulary padding; the checkpoint itself loads at any TP/PP/EP. Vision tower / projector
    tensors are not stored: mcore-to-hf carries them over from ``--hf-reference``.
    """
    out = Path(out)
    with HFReader(hf) as reader:
        arch = ModelArch.from_hf_config(reader.config)
        ParallelDims(tp=tp, pp=pp, dp=ep, ep=ep).check_model(
            num_layers=arch.num_layers, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
            num_experts=arch.num_experts)
        layout = detect_layout(reader.keys(), reader.config)
        check_text_tensors(reader, arch, layout)
        mcore_io.check_save_prerequisites()
        padded = padded_vocab_size(arch.vocab_size, tp)
        with staging_dir(out) as tmp, single_process_world() as ctx:
            shard_layout = mcore_io.sharded_layout(arch, ctx)
            sharded = {}
            for layer in tqdm(list(mcore_io.iter_layers(arch)), desc="hf-to-mcore: map", disable=not progress):
                pieces = _mapped_pieces(reader, layout, arch, layer)
                sharded.update(mcore_io.pieces_to_sharded(pieces, arch, shard_layout, padded))
            if progress:
                print(f"hf-to-mcore: writing the dist checkpoint ({len(sharded)} chunks)", flush=True)
            mcore_io.save(sharded, tmp)
            del sharded
            write_model_metadata(tmp, arch, {"hf_path": str(Path(hf).resolve()), "layout": layout.name,
                                             "hf_model_type": reader.config.get("model_type"),
                                             "written_for": {"tp": tp, "pp": pp, "ep": ep,
                                                             "padded_vocab_size": padded}})


def _resolve_arch(mcore: Path, ref: Optional[HFReader]) -> ModelArch:
    meta = read_model_metadata(mcore)
    ref_arch = ModelArch.from_hf_config(ref.config) if ref else None
    if meta is None:
        if ref_arch is None:
            raise ValueError(f"{mcore} has no {MODEL_METADATA}, so its architecture is unknown: pass "
                             "--hf-reference with the HF model it was trained from.")
        return ref_arch
    arch = ModelArch(**meta["arch"])
    if ref_arch is not None and ref_arch != arch:
        diff = {k: (v, getattr(ref_arch, k)) for k, v in arch.to_dict().items() if getattr(ref_arch, k) != v}
        raise ValueError(f"--hf-reference does not describe the checkpoint's model (checkpoint vs reference: "
                         f"{diff}); pass the HF model the checkpoint was converted or trained from.")
    return arch


def _export_text(mcore: Path, arch: ModelArch, layout: HFLayout, ref: Optional[HFReader], writer: ShardedWriter,
                 ctx, progress: bool) -> None:
    shard_layout = mcore_io.sharded_layout(arch, ctx)
    metadata = mcore_io.tensor_metadata(mcore)
    prefix = mcore_io.key_prefix(metadata, shard_layout)
    for layer in tqdm(list(mcore_io.iter_layers(arch)), desc="mcore-to-hf", disable=not progress):
        part = mcore_io.load(mcore, megatron_names(arch, layer), arch, shard_layout, metadata, prefix)
        for name in set(part) & set(_VOCAB_TENSORS):
            part[name] = part[name][: arch.vocab_size]
        for plain, tensor in canonical_to_hf(part, arch).items():
            key = layout.to_checkpoint(plain)
            if ref is not None:
                if key not in ref.files:
                    raise ValueError(f"--hf-reference has no tensor {key!r}; pass the HF model the checkpoint "
                                     "was converted or trained from.")
                tensor = tensor.to(ref.dtype(key))
            writer.add(key, tensor)


def mcore_to_hf(mcore: str | Path, out: str | Path, hf_reference: Optional[str | Path] = None,
                max_shard_bytes: int = 5 * 2**30, progress: bool = True) -> None:
    """Convert a Megatron dist checkpoint (saved at any TP/PP) into an HF model directory at ``out``.

    With ``hf_reference``: the reference's key layout and dtypes, its non-text tensors (vision
    tower, projector) copied unchanged, and its config/tokenizer/generation files. Without: a plain
    causal-LM checkpoint in the stored dtype with a config.json generated from the architecture.
    """
    mcore, out = Path(mcore), Path(out)
    if not mcore_io.is_dist_checkpoint(mcore):
        raise ValueError(f"{mcore} is not a Megatron distributed checkpoint (no metadata.json); point --mcore "
                         "at the directory that holds metadata.json and the .distcp files.")
    ref = HFReader(hf_reference) if hf_reference else None
    try:
        arch = _resolve_arch(mcore, ref)
        layout = detect_layout(ref.keys(), ref.config) if ref else LAYOUTS["causal_lm"]
        with staging_dir(out) as tmp, single_process_world() as ctx:
            writer = ShardedWriter(tmp, max_shard_bytes)
            _export_text(mcore, arch, layout, ref, writer, ctx, progress)
            carried = [k for k in ref.keys() if layout.to_plain(k) is None] if ref else []
            for key in tqdm(carried, desc="mcore-to-hf: non-text tensors", disable=not progress or not carried):
                writer.add(key, ref.get(key))
            writer.finish()
            if ref is not None:
                copy_support_files(ref.path, tmp)
            else:
                dtype = next(iter(mcore_io.tensor_metadata(mcore).values())).dtype
                (tmp / "config.json").write_text(json.dumps(hf_config_from_arch(arch, dtype), indent=2) + "\n")
    finally:
        if ref is not None:
            ref.close()
