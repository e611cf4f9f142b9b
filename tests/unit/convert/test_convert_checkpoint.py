"""apriel-convert end to end on tiny random HF models of every family (CPU).

Expected values come from transformers (logits) and from the input files (round trips), never
from the converter. The multi-rank part (TP=2, PP=2, DP=2 loads + Megatron's own TP=2/PP=2
saves) runs in one torchrun launch of tests/dist/convert_parity.py.
"""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_apriel.convert.checkpoint import hf_to_mcore, mcore_to_hf
from megatron_apriel.entrypoints.convert import main
from megatron_apriel.model.arch import ModelArch
from tests.unit.conftest import run_dist

pytestmark = pytest.mark.integration  # its tests start processes of their own

TOKENS = [[3, 17, 101, 249, 0, 42, 7, 199, 64, 128, 5, 77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def _hf_models():
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {  # name: (model class, config, tp used for hf-to-mcore)
        # GQA 4:1, head_dim 12 != 64/8, untied, vocab 250 (not a multiple of 128 * tp)
        "mistral": (MistralForCausalLM, MistralConfig(vocab_size=250, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=12,
                    sliding_window=None, tie_word_embeddings=False, rope_theta=1e6), 2),
        "llama_tied": (LlamaForCausalLM, LlamaConfig(vocab_size=250, hidden_size=48, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       tie_word_embeddings=True), 1),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=80,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  use_sliding_window=False), 2),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(vocab_size=250, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=False), 1),
    }


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)  # norms away from 1: swaps show


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float()


def _tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _assert_identical(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> {hf dir, mcore dir, arch, HF logits}; each converted once with hf-to-mcore."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for i, (name, (cls, cfg, tp)) in enumerate(_hf_models().items()):
        cfg._attn_implementation = "eager"
        model = cls(cfg).eval()
        _randomize(model, i)
        hf_dir = root / f"{name}_hf"
        model.save_pretrained(hf_dir, max_shard_size="100KB")  # several shards + index
        (hf_dir / "tokenizer.json").write_text('{"fake": "tokenizer"}')
        hf_to_mcore(hf_dir, root / f"{name}_mcore", tp=tp, progress=False)
        out[name] = {"hf": hf_dir, "mcore": root / f"{name}_mcore", "arch": ModelArch.from_hf_dir(hf_dir),
                     "logits": _hf_logits(model), "root": root}
    return out


@pytest.mark.parametrize("name", ["mistral", "llama_tied", "qwen2", "qwen3"])
def test_hf_to_mcore_to_hf_is_bit_identical_with_reference_files(models, name):
    m = models[name]
    back = m["root"] / f"{name}_back"
    mcore_to_hf(m["mcore"], back, hf_reference=m["hf"], max_shard_bytes=64 * 1024, progress=False)
    _assert_identical(_tensors(m["hf"]), _tensors(back))
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in back.glob("*.safetensors")} \
        and len(index["weight_map"]) > 1
    for f in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (back / f).read_bytes() == (m["hf"] / f).read_bytes(), f
    assert not list(back.parent.glob(f".{back.name}*")), "scratch directories left behind"


@pytest.mark.parametrize("name", ["mistral", "llama_tied"])
def test_export_without_reference_loads_in_transformers_with_the_same_logits(models, name):
    from transformers import AutoModelForCausalLM

    m = models[name]
    out = m["root"] / f"{name}_noref"
    assert main(["mcore-to-hf", "--mcore", str(m["mcore"]), "--out", str(out), "--no-progress"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(_hf_logits(model), m["logits"], rtol=0, atol=1e-5)


def _write_llava(src: Path, dst: Path, layout: str) -> dict:
    """A LLaVA checkpoint around ``src``'s text decoder with fake vision tower / projector tensors."""
    body, head, vision = {"legacy": ("language_model.model.", "language_model.lm_head.", ""),
                          "new": ("model.language_model.", "lm_head.", "model.")}[layout]
    text = _tensors(src)
    renamed = {(head + k[len("lm_head."):]) if k.startswith("lm_head.") else body + k[len("model."):]: v
               for k, v in text.items()}
    g = torch.Generator().manual_seed(7)
    extra = {vision + "vision_tower.transformer.layers.0.attention.q_proj.weight":
             torch.randn(16, 16, generator=g).bfloat16(),
             vision + "multi_modal_projector.linear_1.weight": torch.randn(64, 16, generator=g),
             vision + "vision_tower.ln_pre.weight": torch.randn(16, generator=g).half()}
    dst.mkdir()
    names = sorted(renamed) + sorted(extra)
    everything = {**renamed, **extra}
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: everything[k] for k in keys}, dst / fname)
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text_cfg = json.loads((src / "config.json").read_text())
    cfg = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": text_cfg,
           "vision_config": {"model_type": "pixtral", "hidden_size": 16}, "image_token_index": 10}
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "chat_template.jinja").write_text("{{ messages }}")
    return everything


@pytest.mark.parametrize("layout", ["legacy", "new"])
def test_llava_round_trip_carries_vision_tensors_and_keeps_key_layout(models, layout, tmp_path):
    src = tmp_path / f"llava_{layout}"
    original = _write_llava(models["mistral"]["hf"], src, layout)
    assert main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mc"), "--tp", "2", "--no-progress"]) == 0
    meta = json.loads((tmp_path / "mc" / "apriel_model.json").read_text())
    assert meta["arch"]["family"] == "mistral" \
        and meta["source"]["layout"] == {"legacy": "llava_legacy", "new": "llava"}[layout]
    assert main(["mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "back"),
                 "--hf-reference", str(src), "--no-progress"]) == 0
    _assert_identical(original, _tensors(tmp_path / "back"))
    assert (tmp_path / "back" / "chat_template.jinja").is_file()


def run_convert_parity(spec: dict, tmp_path, ranks: int = 2) -> dict:
    """One torchrun of tests/dist/convert_parity.py over ``spec``; its saved results."""
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_dist("convert_parity.py", str(tmp_path / "spec.json"), str(tmp_path / "out.pt"), ranks=ranks)
    return torch.load(tmp_path / "out.pt")


def test_megatron_logits_match_transformers_at_tp2_pp2_dp2_and_export_of_megatron_saves(models, tmp_path):
    """One torchrun launch: every family loaded at TP=2, PP=2 and TP=1/DP=2 from the converted
    checkpoint; the mistral model re-saved by Megatron itself at TP=2 and PP=2, then exported."""
    spec = {"models": [{"name": n, "ckpt": str(m["mcore"]), "arch": asdict(m["arch"])} for n, m in models.items()],
            "tokens": TOKENS,
            "resave": {"name": "mistral", "tp2": str(tmp_path / "resave_tp2"), "pp2": str(tmp_path / "resave_pp2")}}
    results = run_convert_parity(spec, tmp_path)
    for name, m in models.items():
        for layout in ("tp2", "pp2", "tp1_dp2"):
            torch.testing.assert_close(results[(name, layout)], m["logits"], rtol=0, atol=1e-4,
                                       msg=lambda s: f"{name} {layout}: {s}")
    for layout in ("tp2", "pp2"):
        out = tmp_path / f"export_{layout}"
        mcore_to_hf(tmp_path / f"resave_{layout}", out, hf_reference=models["mistral"]["hf"], progress=False)
        _assert_identical(_tensors(models["mistral"]["hf"]), _tensors(out))
