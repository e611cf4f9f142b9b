"""Megatron distributed checkpoints (``megatron.core.dist_checkpointing``) from a single process.

A dist checkpoint stores each parameter as one *global* tensor, whatever TP/PP wrote it: decoder
layers are stacked along a prepended layer axis, the SwiGLU fc1 is [gate; up], QKV keeps
Megatron's grouped layout and the vocabulary is padded. Those global tensors are exactly our
canonical tensors (plus the layer axis and the vocab padding), so one process can write or read
any slice of them, and the trainer then loads the checkpoint at any TP/PP.

Which dist-checkpoint key holds which canonical tensor (e.g. ``input_layernorm.weight`` ->
``decoder.layers.self_attention.linear_qkv.layer_norm_weight``) is read from Megatron itself,
from a one-layer model of the same family (:func:`sharded_layout`), never written by hand.

Why saving hung on CPU (../shared/CPU_NOTES.md): Megatron's writer (``filesystem_async``) forks
one writer process per bucket and waits on a JoinableQueue. (1) Each forked writer calls
``psutil`` *before* its try block; without psutil installed it dies silently and the parent waits
forever. (2) It also starts a ``spawn`` multiprocessing Manager, which re-runs an unguarded
``__main__`` script (a second ``init_process_group`` that blocks). :func:`check_save_prerequisites`
turns (1) into an error; every script of ours keeps ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Mapping, Optional

import torch

from megatron_apriel.convert.mapping import megatron_names
from megatron_apriel.model.arch import ModelArch

_LAYER_PREFIX = "decoder.layers.0."


def check_save_prerequisites() -> None:
    """Fail, with the fix, where Megatron's checkpoint writer would hang instead."""
    if importlib.util.find_spec("psutil") is None:
        raise RuntimeError("megatron.core.dist_checkpointing needs psutil to save (its forked writer calls "
                           "psutil outside its error handling and the save hangs without it): pip install psutil")


@dataclass(frozen=True)
class ShardedLayout:
    """Canonical name (layer-relative for decoder layers) -> dist-checkpoint key."""

    tensor_keys: dict[str, str]
    layer_object_keys: tuple[str, ...]
    """Per-layer ShardedObjects (``_extra_state``) the model expects in the checkpoint."""


def sharded_layout(arch: ModelArch, ctx) -> ShardedLayout:
    """Read the key layout from a tiny one-layer Megatron model with the same structure."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_apriel.model.config import ModelConfig
    from megatron_apriel.model.provider import build_model

    tiny = replace(arch, vocab_size=16, hidden_size=8, ffn_hidden_size=8, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=4)
    model = build_model(ModelConfig(arch=tiny, transformer_impl="local", precision="fp32"), ctx)
    keys, objects = {}, []
    for name, item in model.sharded_state_dict().items():
        rel = name[len(_LAYER_PREFIX):] if name.startswith(_LAYER_PREFIX) else name
        if isinstance(item, ShardedObject):
            assert name.startswith(_LAYER_PREFIX), name
            objects.append(item.key)
        else:
            keys[rel] = item.key
    expected = {n[len(_LAYER_PREFIX):] for n in megatron_names(tiny, 0)} | set(megatron_names(tiny))
    assert set(keys) == expected, f"conversion table and Megatron disagree: {sorted(set(keys) ^ expected)}"
    return ShardedLayout(tensor_keys=keys, layer_object_keys=tuple(objects))


def _split_layer(name: str) -> tuple[Optional[int], str]:
    if name.startswith("decoder.layers."):
        idx, rel = name[len("decoder.layers."):].split(".", 1)
        return int(idx), rel
    return None, name


def pieces_to_sharded(pieces: Mapping[str, list[tuple[int, torch.Tensor]]], arch: ModelArch,
                      layout: ShardedLayout, padded_vocab: int) -> dict:
    """Canonical tensors given as row pieces ``(first_row, tensor)`` -> one ShardedTensor per piece.

    Each piece is stored as its own chunk of the global checkpoint tensor (uneven sharding, which
    torch DCP reassembles at load for any TP/PP), so no canonical tensor is ever built: the
    writer reads every piece straight from wherever its tensor lives (e.g. the mapped HF file).
    Decoder-layer pieces sit at their layer along the stacked axis; vocabulary tensors get a zero
    piece for the padding rows. Adds each layer's ShardedObjects.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out, layers = {}, set()
    for name, parts in pieces.items():
        layer, rel = _split_layer(name)
        rows = sum(t.shape[0] for _, t in parts)
        if rel in ("embedding.word_embeddings.weight", "output_layer.weight") and padded_vocab > rows:
            parts = [*parts, (rows, parts[0][1].new_zeros((padded_vocab - rows, *parts[0][1].shape[1:])))]
            rows = padded_vocab
        dtypes = {t.dtype for _, t in parts}
        if len(dtypes) != 1:
            raise ValueError(f"{name} is built from HF tensors of different dtypes {sorted(map(str, dtypes))}; "
                             "cast the HF checkpoint to one dtype first.")
        for row, tensor in parts:
            shape = (rows, *tensor.shape[1:])
            offset = (row,) + (0,) * (tensor.dim() - 1)
            if layer is not None:
                layers.add(layer)
                tensor, shape, offset = tensor.unsqueeze(0), (arch.num_layers, *shape), (layer, *offset)
            out[f"{name}@{row}"] = ShardedTensor(layout.tensor_keys[rel], tensor, tensor.dtype, tuple(tensor.shape),
                                                 shape, offset, axis_fragmentations=None, replica_id=0)
    for layer in sorted(layers):
        for key in layout.layer_object_keys:
            out[f"{key}@{layer}"] = ShardedObject(key, None, (arch.num_layers,), (layer,), replica_id=0)
    return out


def save(sharded: dict, out_dir: Path) -> None:
    from megatron.core import dist_checkpointing

    check_save_prerequisites()
    out_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded, str(out_dir))


def is_dist_checkpoint(path: Path) -> bool:
    return (Path(path) / "metadata.json").is_file()


def tensor_metadata(ckpt_dir: Path) -> dict:
    """Dist-checkpoint key -> ShardedTensor without data (global shape and dtype)."""
    from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load_tensors_metadata(str(ckpt_dir)))


def key_prefix(metadata: Mapping, layout: ShardedLayout) -> str:
    """The prefix the writer put before the model's keys ('' for ours), found from the final norm."""
    anchor = layout.tensor_keys["decoder.final_layernorm.weight"]
    found = [k[: -len(anchor)] for k in metadata if k.endswith(anchor)]
    if len(found) != 1:
        raise ValueError(f"cannot find the model's tensors in the checkpoint: expected exactly one key ending "
                         f"in {anchor!r}, found {found}. Is it a checkpoint of a GPT model?")
    return found[0]


def load(ckpt_dir: Path, names: list[str], arch: ModelArch, layout: ShardedLayout, metadata: Mapping,
         prefix: str) -> dict[str, torch.Tensor]:
    """Read the canonical tensors ``names`` (e.g. one layer) from a dist checkpoint of any TP/PP.

    Vocabulary tensors come back unpadded (``arch.vocab_size`` rows); dtypes are as stored.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sharded = {}
    for name in names:
        layer, rel = _split_layer(name)
        key = prefix + layout.tensor_keys[rel]
        if key not in metadata:
            raise ValueError(f"{ckpt_dir} has no tensor {key!r} (canonical {name}): the checkpoint does not "
                             f"match the architecture ({arch.family}, qkv_bias={arch.qkv_bias}, "
                             f"qk_norm={arch.qk_norm}, tied={arch.tie_embeddings}).")
        shape, dtype = tuple(metadata[key].global_shape), metadata[key].dtype
        if layer is None:
            buf = torch.empty(shape, dtype=dtype)
            sharded[name] = ShardedTensor.from_rank_offsets(key, buf, replica_id=0)
        else:
            if shape[0] != arch.num_layers:
                raise ValueError(f"{key} holds {shape[0]} layers but the architecture has {arch.num_layers}: "
                                 "the metadata / --hf-reference config does not match the checkpoint.")
            # A [1, ...] slice of the stacked tensor, without a "prepended" axis: Megatron's
            # prepended-axis path assumes every other layer lives on another rank, and this
            # world has one rank.
            buf = torch.empty((1, *shape[1:]), dtype=dtype)
            sharded[name] = ShardedTensor.from_rank_offsets(key, buf, (0, layer, arch.num_layers), replica_id=0)
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir), validate_access_integrity=False)
    return {n: loaded[n] if _split_layer(n)[0] is None else loaded[n][0] for n in names}


def iter_layers(arch: ModelArch) -> Iterator[Optional[int]]:
    """None (embedding, final norm, output layer) then every decoder layer."""
    yield None
    yield from range(arch.num_layers)
