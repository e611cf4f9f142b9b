"""The conversion table and transforms: round trips and the Megatron QKV layout, on CPU, in-process."""

import pytest
import torch

from megatron_apriel.convert import transforms as T
from megatron_apriel.convert.mapping import (
    LAYOUTS,
    canonical_row_pieces,
    canonical_to_hf,
    detect_layout,
    expected_hf_shapes,
    hf_to_canonical,
    mappings,
    megatron_names,
)
from megatron_apriel.model.arch import ModelArch


def test_merge_qkv_matches_megatron_grouped_layout_written_out_by_hand():
    nq, nkv, d, h = 8, 2, 3, 5  # GQA 4:1, head_dim (3) != hidden / heads
    q = torch.arange(nq * d * h, dtype=torch.float32).reshape(nq * d, h)
    k = -torch.arange(nkv * d * h, dtype=torch.float32).reshape(nkv * d, h) - 1
    v = torch.arange(nkv * d * h, dtype=torch.float32).reshape(nkv * d, h) + 1000
    rows = []
    for g in range(nkv):  # per group: its 4 query heads, then k head g, then v head g
        for j in range(nq // nkv):
            head = g * (nq // nkv) + j
            rows.append(q[head * d:(head + 1) * d])
        rows += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    assert torch.equal(T.merge_qkv(q, k, v, nkv, d), torch.cat(rows))


@pytest.mark.parametrize("nq,nkv,d,rest", [(8, 2, 3, (5,)), (4, 4, 2, (6,)), (6, 1, 4, ()), (4, 2, 16, (7,))])
def test_qkv_round_trip_is_exact(nq, nkv, d, rest):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * d, *rest, generator=g) for n in (nq, nkv, nkv))
    back = T.split_qkv(T.merge_qkv(q, k, v, nkv, d), nq, nkv, d)
    assert all(torch.equal(a, b) and b.is_contiguous() for a, b in zip((q, k, v), back))


def test_gate_up_and_vocab_round_trips():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    fc1 = T.merge_gate_up(gate, up)
    assert torch.equal(fc1[:6], gate) and torch.equal(fc1[6:], up)
    assert all(torch.equal(a, b) for a, b in zip((gate, up), T.split_gate_up(fc1)))
    emb = torch.randn(250, 4)
    padded = T.pad_vocab(emb, 256)
    assert padded.shape == (256, 4) and torch.count_nonzero(padded[250:]) == 0
    assert torch.equal(T.unpad_vocab(padded, 250), emb)


ARCHS = {
    "mistral": ModelArch(family="mistral", vocab_size=250, hidden_size=32, ffn_hidden_size=48, num_layers=2,
                         num_heads=8, num_kv_heads=2, head_dim=12),
    "llama_tied": ModelArch(family="llama", vocab_size=64, hidden_size=32, ffn_hidden_size=40, num_layers=1,
                            num_heads=4, num_kv_heads=4, head_dim=8, tie_embeddings=True),
    "qwen2": ModelArch(family="qwen2", vocab_size=64, hidden_size=32, ffn_hidden_size=40, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True),
    "qwen3": ModelArch(family="qwen3", vocab_size=64, hidden_size=32, ffn_hidden_size=40, num_layers=2,
                       num_heads=4, num_kv_heads=1, head_dim=16, qk_norm=True),
    "qwen3_moe": ModelArch(family="qwen3_moe", vocab_size=64, hidden_size=32, ffn_hidden_size=40, num_layers=3,
                           num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, num_experts=3, moe_top_k=2,
                           moe_ffn_hidden_size=12, dense_layers=[1]),
    "mixtral": ModelArch(family="mixtral", vocab_size=64, hidden_size=32, ffn_hidden_size=24, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=24),
}


def _hf_names(family: str) -> set:
    """The HF parameter names of each family, written out independently of the table (the MoE ones
    as the published Qwen3-30B-A3B and Mixtral-8x7B checkpoints name them)."""
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
             "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight"]
    dense = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    if family == "qwen2":
        layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if family in ("qwen3", "qwen3_moe"):
        layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    arch = ARCHS[family]
    sparse = {"qwen3_moe": ["mlp.gate.weight"] + [f"mlp.experts.{e}.{p}_proj.weight" for e in range(arch.num_experts)
                                                 for p in ("gate", "up", "down")],
              "mixtral": ["block_sparse_moe.gate.weight"] + [f"block_sparse_moe.experts.{e}.w{w}.weight"
                                                              for e in range(arch.num_experts) for w in (1, 2, 3)]}
    top = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if family == "llama_tied" else ["lm_head.weight"])
    names = set(top)
    for i in range(arch.num_layers):
        mlp = sparse[family] if family in sparse and i not in arch.dense_layers else dense
        names |= {f"model.layers.{i}.{n}" for n in layer + mlp}
    return names


@pytest.mark.parametrize("family", sorted(ARCHS))
def test_table_covers_exactly_the_hf_names_and_round_trips(family):
    arch = ARCHS[family]
    shapes = expected_hf_shapes(arch)
    for i in range(arch.num_layers):
        shapes.update(expected_hf_shapes(arch, i))
    assert set(shapes) == _hf_names(family)
    g = torch.Generator().manual_seed(1)
    hf = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    canonical = {}
    for layer in [None, *range(arch.num_layers)]:  # per layer, as the streaming converter calls it
        part = {n: hf[n] for n in (expected_hf_shapes(arch, layer) if layer is not None else expected_hf_shapes(arch))}
        canonical.update(hf_to_canonical(part, arch))
    assert sorted(canonical) == sorted(megatron_names(arch) + [n for i in range(arch.num_layers)
                                                               for n in megatron_names(arch, i)])
    back = canonical_to_hf(canonical, arch)
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)


@pytest.mark.parametrize("family", sorted(ARCHS))
def test_row_pieces_concatenate_to_what_hf_to_canonical_builds(family):
    """hf-to-mcore writes these pieces instead of the merged tensors: they must be the same rows."""
    arch = ARCHS[family]
    g = torch.Generator().manual_seed(2)
    for layer in [None, *range(arch.num_layers)]:
        hf = {n: torch.randn(s, generator=g) for n, s in expected_hf_shapes(arch, layer).items()}
        pieces = canonical_row_pieces(arch, layer)
        canonical = hf_to_canonical(hf, arch)
        assert sorted(pieces) == sorted(canonical)
        for name, ranges in pieces.items():
            assert torch.equal(torch.cat([hf[n][a:b] for n, a, b in ranges]), canonical[name]), name


def test_mapping_rows_know_their_tp_axis_and_vocab_rows():
    rows = {m.megatron: m for m in mappings(ARCHS["qwen2"])}
    assert rows["decoder.layers.{layer}.self_attention.linear_proj.weight"].tp_axis == 1
    assert rows["decoder.layers.{layer}.input_layernorm.weight"].tp_axis is None
    assert rows["embedding.word_embeddings.weight"].vocab and rows["output_layer.weight"].vocab


def test_unmapped_or_incomplete_tensors_are_refused_with_their_name():
    arch = ARCHS["mistral"]
    with pytest.raises(ValueError, match="o_proj.bias"):
        hf_to_canonical({"model.layers.0.self_attn.o_proj.bias": torch.zeros(32)}, arch)
    with pytest.raises(ValueError, match="k_proj"):
        hf_to_canonical({"model.layers.0.self_attn.q_proj.weight": torch.zeros(96, 32)}, arch)
    with pytest.raises(ValueError, match="layer 5"):
        hf_to_canonical({"model.layers.5.input_layernorm.weight": torch.zeros(32)}, arch)


def test_layouts_are_detected_and_checked_against_the_config():
    llava = {"model_type": "llava"}
    assert detect_layout(["model.language_model.layers.0.x", "lm_head.weight", "model.vision_tower.a"],
                         llava).name == "llava"
    assert detect_layout(["language_model.model.norm.weight", "vision_tower.a"], llava).name == "llava_legacy"
    assert detect_layout(["model.norm.weight", "lm_head.weight"], {"model_type": "llama"}).name == "causal_lm"
    with pytest.raises(ValueError, match="model_type"):
        detect_layout(["model.norm.weight"], llava)
    layout = LAYOUTS["llava_legacy"]
    assert layout.to_checkpoint("lm_head.weight") == "language_model.lm_head.weight"
    assert layout.to_plain("language_model.model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"
    assert layout.to_plain("multi_modal_projector.linear_1.weight") is None
    assert LAYOUTS["llava"].to_plain("model.vision_tower.patch_conv.weight") is None
