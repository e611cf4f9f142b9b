"""The declarative Megatron <-> Hugging Face parameter table, used in both directions.

One row (:class:`ParamMapping`) per canonical Megatron parameter (the TP=1/PP=1/EP=1,
unpadded-vocab names of :mod:`megatron_apriel.model.state`) lists the Hugging Face tensor(s) it is
made of and the transform kind that joins / splits them. ``{layer}`` stands for the global layer
index and ``{expert}`` for the global expert index (one concrete parameter per expert). A row may
apply to some layers only: the dense MLP to dense layers, router and experts to the sparse layers
of a mixture of experts. HF names are written in the plain causal-LM form
(``model.layers.{layer}...``, ``lm_head.weight``); :class:`HFLayout` maps them onto the key
layout of a concrete checkpoint (plain, LLaVA before transformers 4.52, LLaVA since 4.52).

The same rows drive import (HF -> Megatron), export (Megatron -> HF) and the weight sender,
which calls :func:`canonical_to_hf` on one layer's tensors at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Optional

from megatron_apriel.convert import transforms as T
from megatron_apriel.model.arch import ModelArch

if TYPE_CHECKING:  # imported where tensors are built: apriel-train's dry run reads shapes only
    import torch

LAYER = "{layer}"
EXPERT = "{expert}"
MLP_KINDS = (None, "dense", "moe")


@dataclass(frozen=True)
class ParamMapping:
    """One canonical Megatron parameter <-> its Hugging Face tensor(s)."""

    megatron: str
    """Canonical Megatron name; ``{layer}`` stands for the global decoder-layer index, ``{expert}``
    for the global expert index."""
    hf: tuple[str, ...]
    """Plain causal-LM HF names, in the order the transform takes them (q, k, v / gate, up)."""
    kind: str = "identity"
    """Transform: identity, qkv (GQA-grouped merge/split) or gate_up (SwiGLU fc1 merge/split)."""
    tp_axis: Optional[int] = None
    """Dimension Megatron's tensor parallelism splits (None: replicated on every TP rank; experts
    are whole on their expert-parallel rank)."""
    vocab: bool = False
    """Rows are vocabulary entries: Megatron pads them up to a multiple of 128 * tp."""
    when: Optional[str] = None
    """Present only if the ModelArch condition holds: qkv_bias, qk_norm or untied."""
    mlp: Optional[str] = None
    """Present only in the layers whose MLP is ``dense`` or ``moe`` (None: every layer)."""

    def __post_init__(self) -> None:
        assert self.kind in _TRANSFORMS, self.kind
        assert self.mlp in MLP_KINDS, self.mlp
        assert len(self.hf) == _TRANSFORMS[self.kind].arity, (self.megatron, self.hf)
        assert (LAYER in self.megatron) == all(LAYER in h for h in self.hf), self
        assert (EXPERT in self.megatron) == all(EXPERT in h for h in self.hf), self
        assert self.mlp is None or self.per_layer, self

    @property
    def per_layer(self) -> bool:
        return LAYER in self.megatron

    @property
    def per_expert(self) -> bool:
        return EXPERT in self.megatron

    def in_layer(self, arch: ModelArch, layer: Optional[int]) -> bool:
        """Whether this row has parameters in ``layer`` (None: the non-layer parameters)."""
        if self.per_layer != (layer is not None):
            return False
        return self.mlp is None or (self.mlp == "moe") == arch.is_moe_layer(layer)

    def experts(self, arch: ModelArch) -> tuple[Optional[int], ...]:
        return tuple(range(arch.num_experts)) if self.per_expert else (None,)

    def megatron_name(self, layer: Optional[int] = None, expert: Optional[int] = None) -> str:
        return self.megatron.replace(LAYER, str(layer)).replace(EXPERT, str(expert))

    def hf_names(self, layer: Optional[int] = None, expert: Optional[int] = None) -> tuple[str, ...]:
        return tuple(h.replace(LAYER, str(layer)).replace(EXPERT, str(expert)) for h in self.hf)


@dataclass(frozen=True)
class _Transform:
    arity: int
    to_megatron: Callable[..., torch.Tensor]  # (arch, *hf tensors) -> canonical tensor
    to_hf: Callable[..., tuple]  # (arch, canonical tensor) -> hf tensors
    row_pieces: Callable[..., list]  # (arch, rows of each hf tensor) -> to_megatron as T.RowPiece list


_TRANSFORMS = {
    "identity": _Transform(1, lambda arch, t: t, lambda arch, t: (t,), lambda arch, n: [(0, 0, n)]),
    "qkv": _Transform(
        3,
        lambda arch, q, k, v: T.merge_qkv(q, k, v, arch.num_kv_heads, arch.head_dim),
        lambda arch, t: T.split_qkv(t, arch.num_heads, arch.num_kv_heads, arch.head_dim),
        lambda arch, nq, nk, nv: T.qkv_row_pieces(nq, arch.num_kv_heads, arch.head_dim),
    ),
    "gate_up": _Transform(2, lambda arch, g, u: T.merge_gate_up(g, u), lambda arch, t: T.split_gate_up(t),
                          lambda arch, ng, nu: T.gate_up_row_pieces(ng)),
}

_M, _H = "decoder.layers.{layer}.", "model.layers.{layer}."
_ATTN, _MLP = _H + "self_attn.", _H + "mlp."
_EXPERT = _M + "mlp.experts.local_experts.{expert}."

ATTENTION = (
    ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), tp_axis=0, vocab=True),
    ParamMapping(_M + "input_layernorm.weight", (_H + "input_layernorm.weight",)),
    ParamMapping(_M + "self_attention.linear_qkv.weight",
                 (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"), "qkv", tp_axis=0),
    ParamMapping(_M + "self_attention.linear_qkv.bias",
                 (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"), "qkv", tp_axis=0,
                 when="qkv_bias"),
    ParamMapping(_M + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",), tp_axis=1),
    ParamMapping(_M + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",)),
    ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ParamMapping("output_layer.weight", ("lm_head.weight",), tp_axis=0, vocab=True, when="untied"),
)
DENSE_MLP = (
    ParamMapping(_M + "mlp.linear_fc1.weight", (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"), "gate_up",
                 tp_axis=0, mlp="dense"),
    ParamMapping(_M + "mlp.linear_fc2.weight", (_MLP + "down_proj.weight",), tp_axis=1, mlp="dense"),
)
DENSE = ATTENTION + DENSE_MLP
QK_NORM = (
    ParamMapping(_M + "self_attention.q_layernorm.weight", (_ATTN + "q_norm.weight",), when="qk_norm"),
    ParamMapping(_M + "self_attention.k_layernorm.weight", (_ATTN + "k_norm.weight",), when="qk_norm"),
)


def _experts(router: str, gate: str, up: str, down: str) -> tuple[ParamMapping, ...]:
    """A sparse layer: the router and each expert's SwiGLU (HF names relative to the layer)."""
    return (
        ParamMapping(_M + "mlp.router.weight", (_H + router,), mlp="moe"),
        ParamMapping(_EXPERT + "linear_fc1.weight", (_H + gate, _H + up), "gate_up", mlp="moe"),
        ParamMapping(_EXPERT + "linear_fc2.weight", (_H + down,), mlp="moe"),
    )


QWEN3_MOE = _experts("mlp.gate.weight", "mlp.experts.{expert}.gate_proj.weight",
                     "mlp.experts.{expert}.up_proj.weight", "mlp.experts.{expert}.down_proj.weight")
MIXTRAL = _experts("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{expert}.w1.weight",
                   "block_sparse_moe.experts.{expert}.w3.weight", "block_sparse_moe.experts.{expert}.w2.weight")
TABLES: dict[str, tuple[ParamMapping, ...]] = {
    "mistral": DENSE,
    "llama": DENSE,
    "qwen2": DENSE,
    "qwen3": DENSE + QK_NORM,
    "qwen3_moe": DENSE + QK_NORM + QWEN3_MOE,
    "mixtral": DENSE + MIXTRAL,
}
"""Family -> rows. Qwen2 differs only by its qkv bias and Qwen3 by qk-norm, both arch flags; the
MoE families add a router and per-expert SwiGLUs in their sparse layers (the checkpoints' own
per-expert names, as published: ``mlp.experts.{e}.gate_proj`` for Qwen3-MoE,
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down) for Mixtral)."""

_CONDITIONS = {
    "qkv_bias": lambda arch: arch.qkv_bias,
    "qk_norm": lambda arch: arch.qk_norm,
    "untied": lambda arch: not arch.tie_embeddings,
}


def mappings(arch: ModelArch) -> tuple[ParamMapping, ...]:
    """The rows that apply to this architecture."""
    if arch.family not in TABLES:
        raise ValueError(f"no conversion table for family {arch.family!r}; supported: {sorted(TABLES)}.")
    return tuple(m for m in TABLES[arch.family] if m.when is None or _CONDITIONS[m.when](arch))


def concrete(arch: ModelArch, layer: Optional[int]) -> Iterator[tuple[ParamMapping, Optional[int]]]:
    """Every (row, expert) pair with parameters in ``layer`` (None: the non-layer parameters)."""
    for m in mappings(arch):
        if m.in_layer(arch, layer):
            for expert in m.experts(arch):
                yield m, expert


def canonical_shape(name: str, arch: ModelArch) -> tuple[int, ...]:
    """Shape of a canonical Megatron tensor (vocab unpadded), from the architecture alone."""
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    h, f, v, d = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size, arch.head_dim
    fe = arch.moe_ffn_hidden_size
    shapes = {
        "embedding.word_embeddings.weight": (v, h), "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (qkv_rows, h), "self_attention.linear_qkv.bias": (qkv_rows,),
        "self_attention.q_layernorm.weight": (d,), "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, arch.num_heads * d), "pre_mlp_layernorm.weight": (h,),
        "mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f),
        "mlp.router.weight": (arch.num_experts, h),
        "mlp.experts.local_experts.linear_fc1.weight": (2 * fe, h),
        "mlp.experts.local_experts.linear_fc2.weight": (h, fe),
        "decoder.final_layernorm.weight": (h,), "output_layer.weight": (v, h),
    }
    rel = _EXPERT_RE["megatron"].sub(".local_experts.", _LAYER_RE["megatron"].sub("", name))
    return shapes[rel]


def canonical_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of the model (global layer and expert indices) -> its shape."""
    names = megatron_names(arch) + [n for i in range(arch.num_layers) for n in megatron_names(arch, i)]
    return {name: canonical_shape(name, arch) for name in names}


def expected_hf_shapes(arch: ModelArch, layer: Optional[int] = None) -> dict[str, tuple[int, ...]]:
    """Plain HF name -> shape for one layer (``layer``) or the non-layer tensors (None)."""
    import torch

    out = {}
    for m, expert in concrete(arch, layer):
        meta = torch.empty(canonical_shape(m.megatron_name(layer, expert), arch), device="meta")
        for name, t in zip(m.hf_names(layer, expert), _TRANSFORMS[m.kind].to_hf(arch, meta)):
            out[name] = tuple(t.shape)
    return out


def canonical_row_pieces(arch: ModelArch, layer: Optional[int] = None) -> dict[str, list[tuple[str, int, int]]]:
    """Canonical name -> ``(plain HF name, first_row, end_row)`` ranges whose concatenation along
    dim 0 is what :func:`hf_to_canonical` builds (vocab unpadded), for one layer or the non-layer
    tensors: lets hf-to-mcore write each canonical tensor straight from the HF files."""
    shapes = expected_hf_shapes(arch, layer)
    out = {}
    for m, expert in concrete(arch, layer):
        names = m.hf_names(layer, expert)
        pieces = _TRANSFORMS[m.kind].row_pieces(arch, *(shapes[n][0] for n in names))
        out[m.megatron_name(layer, expert)] = [(names[src], start, end) for src, start, end in pieces]
    return out


def megatron_names(arch: ModelArch, layer: Optional[int] = None) -> list[str]:
    """Canonical names of one layer (``layer``) or of the non-layer parameters (None)."""
    return [m.megatron_name(layer, expert) for m, expert in concrete(arch, layer)]


_LAYER_RE = {"megatron": re.compile(r"^decoder\.layers\.(\d+)\."), "hf": re.compile(r"^model\.layers\.(\d+)\.")}
_EXPERT_RE = {"megatron": re.compile(r"\.local_experts\.(\d+)\."), "hf": re.compile(r"\.experts\.(\d+)\.")}
_PATTERN_PREFIX = {"megatron": _M, "hf": _H}
_EXPERT_PATTERN = {"megatron": ".local_experts.{expert}.", "hf": ".experts.{expert}."}


def _lookup(name: str, side: str, arch: ModelArch) -> tuple[ParamMapping, Optional[int], Optional[int], int]:
    """(row, layer, expert, position of ``name`` among the row's HF names) for a concrete name."""
    match = _LAYER_RE[side].match(name)
    layer = int(match.group(1)) if match else None
    pattern = _PATTERN_PREFIX[side] + name[match.end():] if match else name
    found = _EXPERT_RE[side].search(pattern)
    expert = int(found.group(1)) if found else None
    if found:
        pattern = pattern[:found.start()] + _EXPERT_PATTERN[side] + pattern[found.end():]
    if layer is not None and not 0 <= layer < arch.num_layers:
        raise ValueError(f"{name!r}: layer {layer} is outside the model's {arch.num_layers} layers "
                         "(num_hidden_layers in config.json does not match the weights).")
    if expert is not None and not 0 <= expert < arch.num_experts:
        raise ValueError(f"{name!r}: expert {expert} is outside the model's {arch.num_experts} experts "
                         "(num_experts / num_local_experts in config.json does not match the weights).")
    for m in mappings(arch):
        names = (m.megatron,) if side == "megatron" else m.hf
        if pattern in names and m.in_layer(arch, layer):
            return m, layer, expert, names.index(pattern)
    raise ValueError(f"tensor {name!r} has no counterpart in the {arch.family} conversion table "
                     f"(qkv_bias={arch.qkv_bias}, qk_norm={arch.qk_norm}, tied={arch.tie_embeddings}, "
                     f"dense layers of a MoE model: {arch.dense_layers}); the config.json does not describe these "
                     "weights, or this variant is not supported.")


def hf_to_canonical(hf: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Plain-named HF tensors -> canonical Megatron tensors. Works on any set of complete rows
    (e.g. one layer): a row whose HF tensors are only partly present is an error."""
    groups: dict[tuple[str, Optional[int], Optional[int]], dict[int, torch.Tensor]] = {}
    rows: dict[tuple[str, Optional[int], Optional[int]], ParamMapping] = {}
    for name, tensor in hf.items():
        m, layer, expert, pos = _lookup(name, "hf", arch)
        groups.setdefault((m.megatron, layer, expert), {})[pos] = tensor
        rows[(m.megatron, layer, expert)] = m
    out = {}
    for key, parts in groups.items():
        m, layer, expert = rows[key], key[1], key[2]
        missing = [n for i, n in enumerate(m.hf_names(layer, expert)) if i not in parts]
        if missing:
            raise ValueError(f"{m.megatron_name(layer, expert)} needs {missing} as well; the checkpoint is incomplete.")
        out[m.megatron_name(layer, expert)] = _TRANSFORMS[m.kind].to_megatron(
            arch, *(parts[i] for i in range(len(parts))))
    return out


def canonical_to_hf(canonical: Mapping[str, torch.Tensor], arch: ModelArch) -> dict[str, torch.Tensor]:
    """Canonical Megatron tensors (any subset, e.g. one layer) -> plain-named HF tensors."""
    out = {}
    for name, tensor in canonical.items():
        m, layer, expert, _ = _lookup(name, "megatron", arch)
        out.update(zip(m.hf_names(layer, expert), _TRANSFORMS[m.kind].to_hf(arch, tensor)))
    return out


@dataclass(frozen=True)
class HFLayout:
    """Where the text decoder's tensors live in a checkpoint; everything else is carried through."""

    name: str
    body: str
    """Prefix that replaces the plain ``model.`` (decoder body)."""
    head: str
    """Prefix that replaces the plain ``lm_head.`` (output projection)."""

    def to_checkpoint(self, plain: str) -> str:
        if plain.startswith("lm_head."):
            return self.head + plain[len("lm_head."):]
        assert plain.startswith("model."), plain
        return self.body + plain[len("model."):]

    def to_plain(self, key: str) -> Optional[str]:
        """The plain name of a text-decoder tensor, or None for tensors carried through untouched."""
        if key.startswith(self.body):
            return "model." + key[len(self.body):]
        if key.startswith(self.head):
            return "lm_head." + key[len(self.head):]
        return None


LAYOUTS = {
    "causal_lm": HFLayout("causal_lm", body="model.", head="lm_head."),
    "llava_legacy": HFLayout("llava_legacy", body="language_model.model.", head="language_model.lm_head."),
    "llava": HFLayout("llava", body="model.language_model.", head="lm_head."),
}
WRAPPER_MODEL_TYPES = ("llava", "mistral3")


def detect_layout(keys, config: dict) -> HFLayout:
    """The layout of a checkpoint, from its tensor names, checked against its config's model_type."""
    keys = list(keys)
    for name, marker in (("llava", "model.language_model."), ("llava_legacy", "language_model.model."),
                         ("causal_lm", "model.")):
        if any(k.startswith(marker) for k in keys):
            layout = LAYOUTS[name]
            break
    else:
        raise ValueError(f"cannot tell where the text decoder is from the tensor names (e.g. {keys[:3]}); "
                         "expected model.*, language_model.model.* or model.language_model.*.")
    wrapped = config.get("model_type") in WRAPPER_MODEL_TYPES
    if wrapped != (layout.name != "causal_lm"):
        raise ValueError(f"config.json model_type={config.get('model_type')!r} does not match the "
                         f"{layout.name} tensor layout; is config.json from another checkpoint?")
    return layout
