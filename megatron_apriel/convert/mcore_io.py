"""Megatron distributed checkpoints (``megatron.core.dist_checkpointing``) from a single process.

A dist checkpoint stores each parameter as one *global* tensor, whatever TP/PP wrote it: decoder
layers are stacked along a prepended layer axis, the SwiGLU fc1 is [gate; up], QKV keeps
Megatron's grouped layout and the vocabulary is padded. Those global tensors are exactly our
canonical tensors (plus the layer axis and the vocab padding), so one process can write or read
any slice of them, and the trainer then loads the checkpoint at any TP/PP.

Which dist-checkpoint key holds which canonical tensor (e.g. ``input_layernorm.weight`` ->
``decoder.layers.self_attention.linear_qkv.layer_norm_weight``) is read from Megatron itself,
from a one-layer model of the same family (:func:`sharded_layout`; a dense and a sparse layer for
a MoE model that has both), never written by hand. Experts sit along an expert axis of the global
tensor, so a checkpoint written at one EP loads at any other.

Why saving hung on CPU (../shared/CPU_NOTES.md): Megatron's writer (``filesystem_async``) forks
one writer process per bucket and waits on a JoinableQueue. (1) Each forked writer calls
``psutil`` *before* its try block; without psutil installed it dies silently and the parent waits
forever. (2) It also starts a ``spawn`` multiprocessing Manager, which re-runs an unguarded
``__main__`` script (a second ``init_process_group`` that blocks). :func:`check_save_prerequisites`
turns (1) into an error; every script of ours keeps ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Mapping, Optional

import torch

from megatron_apriel.convert.mapping import megatron_names
from megatron_apriel.model.arch import ModelArch

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_NAME = re.compile(r"\.local_experts\.(\d+)\.")


def check_save_prerequisites() -> None:
    """Fail, with the fix, where Megatron's checkpoint writer would hang instead."""
    if importlib.util.find_spec("psutil") is None:
        raise RuntimeError("megatron.core.dist_checkpointing needs psutil to save (its forked writer calls "
                           "psutil outside its error handling and the save hangs without it): pip install psutil")


@dataclass(frozen=True)
class ShardedLayout:
    """Canonical name (layer- and expert-relative: ``{layer}`` / ``{expert}`` stripped) -> dist-checkpoint key.

    Megatron stores a decoder layer's tensor either stacked with the other layers' (a prepended
    layer axis, one key for all layers: dense models and MoE models without dense layers) or, when
    layers differ (a MoE model with dense layers: ``moe_layer_freq`` is a list), under a key of its
    own, ``decoder.layers.{layer}....``. An expert's tensor has an expert axis after the layer axis."""

    tensor_keys: dict[str, str]
    layer_object_keys: tuple[tuple[str, bool, Optional[bool]], ...]
    """Per-layer ShardedObjects (``_extra_state``) the model expects: (key, one per expert, in sparse
    layers only (True), dense layers only (False) or every layer (None))."""
    stacked: bool
    """Layers share keys along a prepended layer axis (else ``{layer}`` in the key names the layer)."""

    def key(self, rel: str, layer: Optional[int]) -> str:
        return self.tensor_keys[rel].replace("{layer}", str(layer))


def _relative(name: str) -> tuple[Optional[int], Optional[int], str]:
    """(layer, expert, name with both indices replaced by placeholders removed) of a canonical name."""
    layer, rel = _split_layer(name)
    found = _EXPERT_NAME.search(rel)
    if found is None:
        return layer, None, rel
    return layer, int(found.group(1)), rel[:found.start()] + ".local_experts." + rel[found.end():]


def _tiny_like(arch: ModelArch) -> ModelArch:
    """The smallest model with the same kinds of layers (a dense and a sparse one if it has both)."""
    moe = dict(num_experts=2, moe_top_k=2, moe_ffn_hidden_size=4, dense_layers=[1] if arch.dense_layers else [],
               num_layers=2 if arch.dense_layers else 1) if arch.is_moe else dict(num_layers=1)
    return replace(arch, vocab_size=16, hidden_size=8, ffn_hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                   **moe)


def sharded_layout(arch: ModelArch, ctx) -> ShardedLayout:
    """Read the key layout from a tiny Megatron model with the same structure."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_apriel.model.config import ModelConfig
    from megatron_apriel.model.provider import build_model

    tiny = _tiny_like(arch)
    model = build_model(ModelConfig(arch=tiny, transformer_impl="local", precision="fp32"), ctx)
    keys, objects, stacked = {}, {}, None
    for name, item in model.sharded_state_dict().items():
        layer, _, rel = _relative(name)
        key = item.key
        per_layer_key = _LAYER_KEY.match(key)
        if name.startswith("decoder.layers."):
            stacked = per_layer_key is None
            key = _LAYER_KEY.sub("decoder.layers.{layer}.", key)
        if isinstance(item, ShardedObject):
            assert layer is not None, name
            objects.setdefault((key, ".local_experts." in name), set()).add(tiny.is_moe_layer(layer))
        else:
            keys[rel] = key
    expected = {_relative(n)[2] for i in range(tiny.num_layers) for n in megatron_names(tiny, i)}
    expected |= set(megatron_names(tiny))
    assert set(keys) == expected, f"conversion table and Megatron disagree: {sorted(set(keys) ^ expected)}"
    kinds = {(key, experts, None if len(seen) > 1 else seen.pop()) for (key, experts), seen in objects.items()}
    return ShardedLayout(tensor_keys=keys, layer_object_keys=tuple(sorted(kinds, key=str)), stacked=bool(stacked))


def _split_layer(name: str) -> tuple[Optional[int], str]:
    if name.startswith("decoder.layers."):
        idx, rel = name[len("decoder.layers."):].split(".", 1)
        return int(idx), rel
    return None, name


def _placement(arch: ModelArch, layout: ShardedLayout, layer: Optional[int],
               expert: Optional[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The axes a tensor gets in front of its own: (global sizes, this tensor's offsets)."""
    shape, offset = (), ()
    if layer is not None and layout.stacked:
        shape, offset = (arch.num_layers,), (layer,)
    if expert is not None:
        shape, offset = shape + (arch.num_experts,), offset + (expert,)
    return shape, offset


def pieces_to_sharded(pieces: Mapping[str, list[tuple[int, torch.Tensor]]], arch: ModelArch,
                      layout: ShardedLayout, padded_vocab: int) -> dict:
    """Canonical tensors given as row pieces ``(first_row, tensor)`` -> one ShardedTensor per piece.

    Each piece is stored as its own chunk of the global checkpoint tensor (uneven sharding, which
    torch DCP reassembles at load for any TP/PP/EP), so no canonical tensor is ever built: the
    writer reads every piece straight from wherever its tensor lives (e.g. the mapped HF file).
    Decoder-layer pieces sit at their layer along the stacked axis (if the layout stacks layers),
    expert pieces at their expert along the expert axis; vocabulary tensors get a zero piece for the
    padding rows. Adds each layer's ShardedObjects.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out, layers = {}, set()
    for name, parts in pieces.items():
        layer, expert, rel = _relative(name)
        rows = sum(t.shape[0] for _, t in parts)
        if rel in ("embedding.word_embeddings.weight", "output_layer.weight") and padded_vocab > rows:
            parts = [*parts, (rows, parts[0][1].new_zeros((padded_vocab - rows, *parts[0][1].shape[1:])))]
            rows = padded_vocab
        dtypes = {t.dtype for _, t in parts}
        if len(dtypes) != 1:
            raise ValueError(f"{name} is built from HF tensors of different dtypes {sorted(map(str, dtypes))}; "
                             "cast the HF checkpoint to one dtype first.")
        if layer is not None:
            layers.add(layer)
        lead_shape, lead_offset = _placement(arch, layout, layer, expert)
        for row, tensor in parts:
            shape = lead_shape + (rows, *tensor.shape[1:])
            offset = lead_offset + (row,) + (0,) * (tensor.dim() - 1)
            local = tensor.reshape((1,) * len(lead_shape) + tuple(tensor.shape))
            out[f"{name}@{row}"] = ShardedTensor(layout.key(rel, layer), local, local.dtype, tuple(local.shape),
                                                 shape, offset, axis_fragmentations=None, replica_id=0)
    for layer in sorted(layers):
        for key, per_expert, sparse in layout.layer_object_keys:
            if sparse is not None and sparse != arch.is_moe_layer(layer):
                continue
            key = key.replace("{layer}", str(layer))
            for expert in (range(arch.num_experts) if per_expert else (None,)):
                shape, offset = _placement(arch, layout, layer, expert)
                if not shape:  # a per-layer key without expert: Megatron's own form for it
                    shape, offset = (1,), (0,)
                out[f"{key}@{layer}.{expert}"] = ShardedObject(key, None, shape, offset, replica_id=0)
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
    """Read the canonical tensors ``names`` (e.g. one layer) from a dist checkpoint of any TP/PP/EP.

    Vocabulary tensors come back unpadded (``arch.vocab_size`` rows); dtypes are as stored.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sharded, lead = {}, {}
    for name in names:
        layer, expert, rel = _relative(name)
        key = prefix + layout.key(rel, layer)
        if key not in metadata:
            raise ValueError(f"{ckpt_dir} has no tensor {key!r} (canonical {name}): the checkpoint does not "
                             f"match the architecture ({arch.family}, qkv_bias={arch.qkv_bias}, "
                             f"qk_norm={arch.qk_norm}, tied={arch.tie_embeddings}, experts={arch.num_experts}, "
                             f"dense layers={arch.dense_layers}).")
        shape, dtype = tuple(metadata[key].global_shape), metadata[key].dtype
        lead_shape, lead_offset = _placement(arch, layout, layer, expert)
        if shape[:len(lead_shape)] != lead_shape:
            raise ValueError(f"{key} has shape {shape}, but the architecture puts {lead_shape} (layers, experts) in "
                             "front: the metadata / --hf-reference config does not match the checkpoint.")
        # A [1, ...] slice at each leading axis, without a "prepended" axis: Megatron's
        # prepended-axis path assumes every other layer lives on another rank, and this world has
        # one rank.
        buf = torch.empty((1,) * len(lead_shape) + shape[len(lead_shape):], dtype=dtype)
        axes = [(axis, off, size) for axis, (off, size) in enumerate(zip(lead_offset, lead_shape))]
        sharded[name] = ShardedTensor.from_rank_offsets(key, buf, *axes, replica_id=0)
        lead[name] = len(lead_shape)
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir), validate_access_integrity=False)
    return {n: loaded[n].reshape(loaded[n].shape[lead[n]:]) for n in names}


def iter_layers(arch: ModelArch) -> Iterator[Optional[int]]:
    """None (embedding, final norm, output layer) then every decoder layer."""
    yield None
    yield from range(arch.num_layers)
