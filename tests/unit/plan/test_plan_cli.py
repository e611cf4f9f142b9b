"""apriel-plan end to end on the bundled configs (pure arithmetic, seconds).

Independent expectations: parameter counts from transformers models built on the meta device,
the KV-cache size from the Llama-3-70B shape by hand, and fits/recommendation checked against
the usable memory. Byte-exact state and the activation estimate are tested against real
Megatron allocations in test_plan_memory.py / test_plan_activations.py.
"""

import json
from pathlib import Path

import pytest
import torch

from megatron_apriel.entrypoints.plan import main

pytestmark = pytest.mark.integration  # its tests start processes of their own

CONF = Path(__file__).resolve().parents[3] / "megatron_apriel" / "conf"
CLUSTER = ["--nodes", "8", "--gpus-per-node", "8", "--gpu-memory-gb", "80"]


def _plan(capsys, *args) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _hf_parameters(name: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((CONF / "models" / name / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["apriel_15b", "qwen25_32b", "llama3_70b"])
def test_parameter_count_and_update_bytes_match_transformers(capsys, name):
    plan = _plan(capsys, "--preset", name, *CLUSTER)
    expected = _hf_parameters(name)
    assert plan["model"]["parameters"] == expected
    assert sum(plan["weight_update"]["bytes_per_stage"]) == 2 * expected  # every HF tensor sent once, in bf16


@pytest.mark.parametrize("nodes", ["8", "16"])
def test_llama3_70b_on_64_and_128_h100s(capsys, nodes):
    plan = _plan(capsys, "--preset", "llama3_70b", "--nodes", nodes, "--gpus-per-node", "8", "--gpu-memory-gb", "80")
    trainer_gpus = plan["cluster"]["trainer_nodes"] * 8
    assert trainer_gpus == int(nodes) * 4
    for layout in plan["layouts"]:
        assert layout["tp"] * layout["cp"] * layout["pp"] * layout["dp"] == trainer_gpus and 80 % layout["pp"] == 0
        assert layout["fits"] == [r for r in ("none", "selective", "full") if layout["total_gib"][r] <= 74]
    best = plan["recommended"]
    assert best is not None and best["total_gib"] <= plan["cluster"]["usable_gib"]
    assert plan["fleet"]["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert plan["fleet"]["servers"] * plan["fleet"]["tp_per_server"] == int(nodes) * 4
    assert plan["estimates"] == ["activations", "logits"]


def test_context_parallelism_is_searched_and_taken_where_it_saves_recomputation(capsys):
    """CP 1-8 are sized and CP halves a row's activations and shrinks the head. At the recipe's 20K
    tokens Qwen2.5-32B fits on 4 trainer nodes without CP or recomputation, so no CP is proposed; at
    64K on 8 trainer nodes it takes CP rather than full recomputation."""
    short = _plan(capsys, "--preset", "qwen25_32b", *CLUSTER)
    assert {lay["cp"] for lay in short["layouts"]} == {1, 2, 4, 8}
    assert short["recommended"]["cp"] == 1 and short["recommended"]["recompute"] == "none"
    long = _plan(capsys, "--preset", "qwen25_32b", "--override", "trainer.seq_len=65536", "--nodes", "16",
                 "--gpus-per-node", "8", "--gpu-memory-gb", "80")
    by = {(lay["tp"], lay["pp"], lay["cp"]): lay for lay in long["layouts"]}
    one, two = by[(8, 2, 1)], by[(8, 2, 2)]
    assert two["activations_gib"]["none"] == pytest.approx(one["activations_gib"]["none"] / 2, rel=1e-6)
    assert two["logits_gib"] < one["logits_gib"]
    best = long["recommended"]
    assert best["cp"] > 1 and best["recompute"] != "full", best
    assert not [lay for lay in long["layouts"] if lay["cp"] == 1 and best["recompute"] in lay["fits"]]


def test_text_output_says_what_is_estimated(capsys):
    assert main(["--preset", "qwen25_32b", *CLUSTER]) == 0
    out = capsys.readouterr().out
    assert "ESTIMATES" in out and "recommended: parallel.tp=" in out and "vLLM fleet:" in out


def test_hf_dir_with_run_settings_from_the_recipe(capsys, tmp_path):
    (tmp_path / "config.json").write_text((CONF / "models" / "qwen25_32b" / "config.json").read_text())
    plan = _plan(capsys, "--hf", str(tmp_path), "--override", "trainer.seq_len=32768", *CLUSTER)
    assert plan["run"]["preset"] == "apriel_15b" and plan["run"]["seq_len"] == 32768


ONE_NODE = ["--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "80"]


def test_apriel_15b_on_one_8_gpu_node_splits_it_half_and_half(capsys):
    """Apriel-15B at the recipe's 20K tokens: the trainer fits on half the node; the fleet's figures
    by hand from config.json: bf16 weights on one GPU, KV per token 2 (K, V) x layers x kv heads x
    head_dim x 2 bytes, what 90% of 80 GiB holds beside the weights, in sequences of 20480 tokens."""
    plan = _plan(capsys, "--preset", "apriel_15b", *ONE_NODE)
    c, f = plan["cluster"], plan["fleet"]
    assert (c["trainer_gpus"], c["fleet_gpus"]) == (4, 4)
    for layout in plan["layouts"]:
        assert layout["tp"] * layout["cp"] * layout["pp"] * layout["dp"] == 4
    assert plan["recommended"] and plan["recommended"]["total_gib"] <= 80 - 6
    text = json.loads((CONF / "models" / "apriel_15b" / "config.json").read_text())["text_config"]
    weights = _hf_parameters("apriel_15b") * 2
    per_token = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * text["head_dim"] * 2
    kv = 80 * 2**30 * 0.9 - weights
    assert (f["servers"], f["tp_per_server"]) == (4, 1) and f["kv_bytes_per_token"] == per_token
    assert f["weights_per_gpu_gib"] == pytest.approx(weights / 2**30)
    assert f["kv_cache_per_server_gib"] == pytest.approx(kv / 2**30)
    assert f["full_sequences_per_server"] == int(kv // (per_token * 20480))
    launch = plan["one_node_launch"]
    assert launch[:4] == ["launch.nnodes=1", "launch.gpus_per_node=8", "launch.nproc_per_node=4",
                          "fleet.num_servers=4"]
    # the preset's own vLLM flags are kept; the planned TP is added
    assert launch[4] == 'fleet.vllm_args=["--gpu-memory-utilization","0.9","--max-num-seqs","256",' \
                        '"--no-enable-prefix-caching","--tensor-parallel-size","1"]'
    assert main(["--preset", "apriel_15b", *ONE_NODE]) == 0
    assert "one-node launch: apriel-train --config-name PRESET ... launch.nnodes=1" in capsys.readouterr().out


def test_a_chosen_trainer_share_of_one_node(capsys):
    plan = _plan(capsys, "--preset", "apriel_15b", *ONE_NODE, "--trainer-gpus", "6")
    assert (plan["cluster"]["trainer_gpus"], plan["cluster"]["fleet_gpus"]) == (6, 2)
    assert plan["fleet"]["servers"] * plan["fleet"]["tp_per_server"] == 2


@pytest.mark.parametrize("args, message", [
    (["--preset", "qwen3_30b_a3b", *ONE_NODE], "does not fit one node of 8 x 80 GiB: the trainer needs more than 7"),
    (["--preset", "apriel_15b", *ONE_NODE, "--trainer-gpus", "8"], "--trainer-gpus=8 must leave the fleet"),
])
def test_one_node_refusals_say_what_to_change(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "no preset 'nope'"),
    (["--preset", "tiny_cpu"], "pass --hf DIR"),
    (["--preset", "llama3_70b", "--trainer-nodes", "8"], "leaves no node for vLLM"),
    ([], "give the model"),
])
def test_errors_say_what_to_change(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, *CLUSTER])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_arithmetic_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, megatron_apriel.plan.layouts, megatron_apriel.plan.servers, megatron_apriel.plan.report; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3]).stdout
    assert out.strip() == "False"
