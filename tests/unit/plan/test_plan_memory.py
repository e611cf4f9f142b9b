"""The planner's weights / gradients / optimizer-state bytes equal what Megatron allocates.

Expected values are read from a real Megatron GPTModel + DDP + distributed optimizer on CPU
(gloo; two ranks: TP=2, PP=2 and DP=2; four ranks: PP=2 x DP=2, where the tied embedding's own
buckets change which DP rank owns what; mixtures of experts at EP 2 with DP 2, TP 2 and PP 2,
whose experts sit in buffers of their own sharded over expert-DP), one optimizer step taken, by summing the distinct
storages behind the parameters, their main grads and the optimizer's tensors
(tests/dist/plan_memory.py). The planner never sees a model.
"""

import json
from dataclasses import asdict

import pytest

from megatron_apriel.model.arch import ModelArch
from megatron_apriel.plan.buffers import state_bytes
from megatron_apriel.plan.params import StageShape, stage_params
from tests.unit.conftest import run_dist

pytestmark = pytest.mark.integration  # its tests start processes of their own

QWEN2 = ModelArch(family="qwen2", vocab_size=250, hidden_size=64, ffn_hidden_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=24, qkv_bias=True)
QWEN3_TIED = ModelArch(family="qwen3", vocab_size=300, hidden_size=48, ffn_hidden_size=80, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=12, qk_norm=True, tie_embeddings=True)
LLAMA = ModelArch(family="llama", vocab_size=1000, hidden_size=40, ffn_hidden_size=72, num_layers=2, num_heads=2,
                  num_kv_heads=2, head_dim=20)
CASES = [("qwen2_tp2_fp32", QWEN2, 2, 1, "fp32"), ("qwen2_pp2_fp32", QWEN2, 1, 2, "fp32"),
         ("qwen2_dp2_fp32", QWEN2, 1, 1, "fp32"), ("qwen3_tied_pp2_bf16", QWEN3_TIED, 1, 2, "bf16"),
         ("qwen3_tied_dp2_bf16", QWEN3_TIED, 1, 1, "bf16"), ("llama_tp2_bf16", LLAMA, 2, 1, "bf16"),
         ("llama_dp2_bf16", LLAMA, 1, 1, "bf16")]
CASES_4_RANKS = [("qwen3_tied_pp2_dp2_bf16", QWEN3_TIED, 1, 2, "bf16"), ("qwen2_tp2_dp2_fp32", QWEN2, 2, 1, "fp32")]
QWEN3_MOE = ModelArch(family="qwen3_moe", vocab_size=300, hidden_size=48, ffn_hidden_size=80, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=12, qk_norm=True, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=40,
                      dense_layers=[1])
MIXTRAL = ModelArch(family="mixtral", vocab_size=250, hidden_size=40, ffn_hidden_size=56, num_layers=2, num_heads=2,
                    num_kv_heads=2, head_dim=20, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=56)
MOE_CASES = [("qwen3_moe_ep2_dp2_bf16", QWEN3_MOE, 1, 1, 2, "bf16"), ("mixtral_ep2_tp2_fp32", MIXTRAL, 2, 1, 2, "fp32")]
MOE_CASES_4_RANKS = [("qwen3_moe_ep2_pp2_dp2_bf16", QWEN3_MOE, 1, 2, 2, "bf16"),
                     ("mixtral_ep2_dp4_fp32", MIXTRAL, 1, 1, 2, "fp32")]


def _launch(tmp, cases, ranks: int) -> dict:
    cases = [c if len(c) == 6 else (*c[:4], 1, c[4]) for c in cases]  # (name, arch, tp, pp, ep, precision)
    spec = {"cases": [{"name": n, "arch": asdict(a), "tp": tp, "pp": pp, "ep": ep, "precision": prec}
                      for n, a, tp, pp, ep, prec in cases]}
    (tmp / f"spec{ranks}.json").write_text(json.dumps(spec))
    run_dist("plan_memory.py", str(tmp / f"spec{ranks}.json"), str(tmp / f"out{ranks}.json"), ranks=ranks, timeout=600)
    return json.loads((tmp / f"out{ranks}.json").read_text())


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan_memory")
    return {**_launch(tmp, CASES + MOE_CASES, 2), **_launch(tmp, CASES_4_RANKS + MOE_CASES_4_RANKS, 4)}


ALL = [(*c[:4], 1, c[4]) for c in CASES + CASES_4_RANKS] + MOE_CASES + MOE_CASES_4_RANKS


@pytest.mark.parametrize("name, arch, tp, pp, ep, precision", ALL, ids=[c[0] for c in ALL])
def test_state_bytes_equal_megatron_allocations(measured, name, arch, tp, pp, ep, precision):
    for rank in measured[name]:
        where = StageShape(tp=tp, pp=pp, stage=rank["pp_rank"], ep=ep)
        assert [n for n, _ in stage_params(arch, where)] == rank["param_names"]
        assert [n for _, n in stage_params(arch, where)] == rank["param_numels"]
        plan = state_bytes(arch, where, rank["dp"], rank["dp_rank"], param_bytes=4 if precision == "fp32" else 2,
                           expert_dp_rank=rank["expert_dp_rank"])
        got = {k: getattr(plan, k) for k in ("weights", "grads", "master", "adam", "step_counters")}
        assert got == {k: rank[k] for k in got}, f"rank {rank['rank']}"
