"""Newly accepted configs convert and match transformers: Llama-3 RoPE scaling and a Mistral
sliding window that covers the whole sequence.

Tiny random HF models are built locally; expected logits come from transformers. Each case first
checks that the feature changes transformers' logits here (so the parity below can fail), then
converts with apriel-convert and compares Megatron's logits at TP=2, PP=2 and DP=2 (fp32, 1e-4)
in one torchrun launch of tests/dist/convert_parity.py, and exports without a reference.
"""

from dataclasses import asdict

import pytest
import torch

from megatron_apriel.convert.checkpoint import hf_to_mcore, mcore_to_hf
from megatron_apriel.model.arch import ModelArch
from tests.unit.convert.test_convert_checkpoint import run_convert_parity

pytestmark = pytest.mark.integration  # its tests start processes of their own

SEQ = 64
TOKENS = [[(7 * i + 3) % 250 for i in range(SEQ)], [(11 * i + 5) % 250 for i in range(SEQ)]]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _cases():
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    llama = dict(vocab_size=250, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, rope_theta=10000.0)
    mistral = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return {  # name: (class, accepted config, the same model without the feature (must differ))
        "llama3_rope": (LlamaForCausalLM, LlamaConfig(rope_scaling=dict(LLAMA3), **llama), LlamaConfig(**llama)),
        "mistral_window": (MistralForCausalLM, MistralConfig(sliding_window=SEQ, **mistral),
                           MistralConfig(sliding_window=SEQ - 8, **mistral)),
    }


def _logits(cls, cfg, state) -> torch.Tensor:
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope_window")
    out = {}
    for i, (name, (cls, cfg, other)) in enumerate(_cases().items()):
        torch.manual_seed(i)
        cfg._attn_implementation = "eager"
        model = cls(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        model.save_pretrained(root / f"{name}_hf")
        state = model.state_dict()
        logits = _logits(cls, cfg, state)
        assert (logits - _logits(cls, other, state)).abs().max() > 1e-2, f"{name}: the feature does not matter here"
        hf_to_mcore(root / f"{name}_hf", root / f"{name}_mcore", tp=2, progress=False)
        out[name] = {"hf": root / f"{name}_hf", "mcore": root / f"{name}_mcore", "logits": logits,
                     "arch": ModelArch.from_hf_dir(root / f"{name}_hf")}
    return out


def test_archs_carry_the_feature(converted):
    assert converted["llama3_rope"]["arch"].rope_scaling_factor == 8.0
    assert converted["mistral_window"]["arch"].sliding_window == SEQ
    converted["mistral_window"]["arch"].check_sequence_length(SEQ)


def test_megatron_logits_match_transformers_at_tp2_pp2_dp2(converted, tmp_path):
    spec = {"models": [{"name": n, "ckpt": str(m["mcore"]), "arch": asdict(m["arch"])} for n, m in converted.items()],
            "tokens": TOKENS, "resave": {"name": None}}
    results = run_convert_parity(spec, tmp_path)
    for name, m in converted.items():
        for layout in ("tp2", "pp2", "tp1_dp2"):
            torch.testing.assert_close(results[(name, layout)], m["logits"], rtol=0, atol=1e-4,
                                       msg=lambda s: f"{name} {layout}: {s}")


@pytest.mark.parametrize("name", ["llama3_rope", "mistral_window"])
def test_export_without_reference_keeps_the_feature(converted, name, tmp_path):
    from transformers import AutoModelForCausalLM

    m = converted[name]
    mcore_to_hf(m["mcore"], tmp_path / "hf", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model.eval()(torch.tensor(TOKENS)).logits.float()
    torch.testing.assert_close(logits, m["logits"], rtol=0, atol=1e-5)
