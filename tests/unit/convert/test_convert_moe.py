"""apriel-convert on mixture-of-experts models (Qwen3-MoE with a dense layer, Mixtral), CPU.

The HF checkpoints are written by transformers itself (``save_pretrained``: the published
per-expert names). One 4-rank torchrun of tests/dist/convert_parity.py loads the converted
checkpoint at EP 2 x TP 2 (sequence-parallel), EP 2 x PP 2 and EP 4, compares the logits with
transformers', and has Megatron re-save it at the first two layouts; those saves must export back
to the HF files bit for bit.
"""

from dataclasses import asdict

import pytest
import torch

from megatron_apriel.convert.checkpoint import hf_to_mcore, mcore_to_hf
from megatron_apriel.entrypoints.convert import main
from megatron_apriel.model.arch import ModelArch
from tests.unit.convert.test_convert_checkpoint import (
    TOKENS,
    _assert_identical,
    _hf_logits,
    _randomize,
    _tensors,
    run_convert_parity,
)

pytestmark = pytest.mark.integration  # its tests start processes of their own

LAYOUTS = [["ep2_tp2", 2, 1, 2, True], ["ep2_pp2", 1, 2, 2, False], ["ep4", 1, 1, 4, False]]


def _hf_models():
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=250, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=False, num_experts_per_tok=2)
    return {
        # layer 1 dense (mlp_only_layers), norm_topk_prob false: the unrenormalised routing
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(num_hidden_layers=4, num_experts=4, moe_intermediate_size=32,
                      intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False, **common)),
        "mixtral": (MixtralForCausalLM, MixtralConfig(num_hidden_layers=2, num_local_experts=4, intermediate_size=48,
                    sliding_window=None, **common)),
    }


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_moe")
    out = {}
    for i, (name, (cls, cfg)) in enumerate(_hf_models().items()):
        cfg._attn_implementation = "eager"
        model = cls(cfg).eval()
        _randomize(model, 10 + i)
        hf_dir = root / f"{name}_hf"
        model.save_pretrained(hf_dir, max_shard_size="100KB")
        hf_to_mcore(hf_dir, root / f"{name}_mcore", tp=2, ep=2, progress=False)
        out[name] = {"hf": hf_dir, "mcore": root / f"{name}_mcore", "arch": ModelArch.from_hf_dir(hf_dir),
                     "logits": _hf_logits(model), "root": root}
    return out


def test_transformers_writes_the_published_per_expert_names(models):
    names = set(_tensors(models["qwen3_moe"]["hf"]))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
    assert "model.layers.3.block_sparse_moe.experts.0.w1.weight" not in names
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in set(_tensors(models["mixtral"]["hf"]))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_hf_to_mcore_to_hf_is_bit_identical(models, name):
    m = models[name]
    back = m["root"] / f"{name}_back"
    mcore_to_hf(m["mcore"], back, hf_reference=m["hf"], max_shard_bytes=64 * 1024, progress=False)
    _assert_identical(_tensors(m["hf"]), _tensors(back))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_export_without_reference_loads_in_transformers_with_the_same_logits(models, name):
    from transformers import AutoModelForCausalLM

    m = models[name]
    out = m["root"] / f"{name}_noref"
    assert main(["mcore-to-hf", "--mcore", str(m["mcore"]), "--out", str(out), "--no-progress"]) == 0
    assert set(_tensors(out)) == set(_tensors(m["hf"]))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(_hf_logits(model), m["logits"], rtol=0, atol=1e-5)


def test_experts_must_divide_over_ep(models, tmp_path):
    with pytest.raises(ValueError, match="ep=3 must divide the number of experts"):
        hf_to_mcore(models["mixtral"]["hf"], tmp_path / "x", ep=3, progress=False)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_megatron_logits_match_transformers_at_ep_layouts_and_its_saves_export_bit_identical(models, name, tmp_path):
    m = models[name]
    spec = {"models": [{"name": name, "ckpt": str(m["mcore"]), "arch": asdict(m["arch"])}], "tokens": TOKENS,
            "layouts": LAYOUTS, "resave": {"name": name, "ep2_tp2": str(tmp_path / "resave_ep2_tp2"),
                                           "ep2_pp2": str(tmp_path / "resave_ep2_pp2")}}
    results = run_convert_parity(spec, tmp_path, ranks=4)
    for layout, *_ in LAYOUTS:
        torch.testing.assert_close(results[(name, layout)], m["logits"], rtol=0, atol=1e-4,
                                   msg=lambda s: f"{name} {layout}: {s}")
    for layout in ("ep2_tp2", "ep2_pp2"):
        out = tmp_path / f"export_{layout}"
        mcore_to_hf(tmp_path / f"resave_{layout}", out, hf_reference=m["hf"], progress=False)
        _assert_identical(_tensors(m["hf"]), _tensors(out))
