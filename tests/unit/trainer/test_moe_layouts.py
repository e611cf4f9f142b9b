"""Mixture-of-experts models (Qwen3-MoE with a dense layer, Mixtral) under EP 1, 2 and 4, EP 2 x PP 2
and packed rows, log-probs chunked from hidden states and (EP 2 x TP 2, packed) from the full
logits: the same log-probs, loss, gradient norm, MoE metrics and updated weights; and EP 1
against transformers on the same weights, routing freely and with the routed experts replayed
(transformers' router forced to them), so that a bug every layout shares cannot pass.

Runs tests/dist/moe_layouts.py under ``torchrun --nproc_per_node 4`` (gloo, real Megatron-Core).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from megatron_apriel.convert.hf_config import hf_config_from_arch
from megatron_apriel.convert.mapping import canonical_to_hf
from tests.dist.moe_layouts import ARCHS, GSPO, LAYOUTS, SERVERS, samples
from tests.unit.conftest import run_dist
from tests.unit.trainer.test_loss import reference_gspo

pytestmark = pytest.mark.integration  # its tests start processes of their own

ATOL = 1e-5
HF_ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(ARCHS))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def results(family, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"moe_{family}") / "results.pt"
    run_dist("moe_layouts.py", family, str(out), ranks=4)
    return torch.load(out, weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


PER_SERVER = tuple(f"mismatch/server/{s.split('://')[1]}/routing_{k}" for s in SERVERS
                   for k in ("mismatch", "compared"))
METRICS = ("train/loss", "train/grad_norm", "train/clip_fraction", "train/entropy", "train/tokens",
           "train/routing_mismatch", "train/routing_compared", "moe/busiest_expert_share_mean",
           "moe/busiest_expert_share_max", *PER_SERVER)


@pytest.mark.parametrize("name", [n for n, *_ in LAYOUTS if n not in ("ep1", "ep1_free")])
def test_layouts_agree(results, name):
    base, other = results["ep1"], results[name]
    assert len(base["logp"]) == 8
    assert _max_diff(base["logp"], other["logp"]) < ATOL
    for key in METRICS:
        assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), key
    assert _max_diff(base["weights"], other["weights"]) < ATOL


def test_replay_changes_the_forward_and_the_step_moves_routers_and_experts(results, family):
    assert _max_diff(results["ep1"]["logp"], results["ep1_free"]["logp"]) > 1e-3
    moved = {k: (results["initial"][k] - results["ep1"]["weights"][k]).abs().max().item() for k in results["initial"]}
    assert min(v for k, v in moved.items() if ".router." in k) > 1e-4  # replayed routing still trains the router
    assert min(v for k, v in moved.items() if ".local_experts." in k) > 1e-4


@pytest.mark.parametrize("name", [n for n, *_ in LAYOUTS if n != "ep1_free"])
def test_every_expert_parallel_rank_sends_its_own_experts_and_together_they_send_the_model(results, family, name):
    """What the fleet would receive after the step: every HF tensor exactly once, equal to the
    updated weights; a stage's experts from ``ep`` sources, each the rank that holds them."""
    arch, layout = ARCHS[family], next(entry for entry in LAYOUTS if entry[0] == name)
    _, tp, pp, ep, *_ = layout
    sources = [s for s in results[name]["sources"] if s["source"] >= 0]
    assert sorted(s["source"] for s in sources) == list(range(pp * ep))
    assert all(s["num_sources"] == pp * ep for s in sources)
    received = {}
    for s in sources:
        assert not set(s["tensors"]) & set(received), "a tensor sent twice"
        received.update(s["tensors"])
        per_rank = arch.num_experts // ep
        for tensor in s["tensors"]:
            if ".experts." in tensor:
                expert = int(tensor.split(".experts.")[1].split(".")[0])
                assert expert // per_rank == s["ep_rank"], (tensor, s["ep_rank"])  # its own, never gathered
    want = canonical_to_hf(results[name]["weights"], arch)
    assert sorted(received) == sorted(want)
    assert all(torch.equal(received[k], want[k]) for k in want)


class _Router(torch.nn.Module):
    """transformers' top-k router, optionally forced to given experts (``-1``: its own choice), with
    the HF weighting (softmax over all experts, the chosen ones' probabilities, renormalised when
    ``norm``). Records its own choice and the experts it used."""

    def __init__(self, weight: torch.nn.Parameter, top_k: int, norm: bool, forced_NK=None):
        super().__init__()
        self.weight, self.top_k, self.norm, self.forced_NK = weight, top_k, norm, forced_NK
        self.own_NK = self.used_NK = None

    def forward(self, hidden):
        logits = F.linear(hidden.reshape(-1, self.weight.shape[1]), self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        self.own_NK = probs.topk(self.top_k, dim=-1).indices
        used = self.own_NK if self.forced_NK is None else torch.where(self.forced_NK >= 0, self.forced_NK, self.own_NK)
        self.used_NK = used
        weights = probs.gather(1, used)
        if self.norm:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), used


def _hf_model(arch, canonical: dict, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    save_file({k: v.contiguous() for k, v in canonical_to_hf(canonical, arch).items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_arch(arch, torch.float32)))
    return AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")


def _reference(arch, canonical, tmp_path, replay: bool) -> dict:
    """transformers on the initial weights, per sample: log-probs, the GSPO loss and its gradient
    norm, the mismatch on fresh positions and the experts' load, computed here by hand."""
    model = _hf_model(arch, canonical, tmp_path)
    sparse = [layer for layer in model.model.layers if arch.is_moe_layer(layer.self_attn.layer_idx)]
    routers = [_Router(layer.mlp.gate.weight, arch.moe_top_k, arch.norm_topk_prob) for layer in sparse]
    for layer, router in zip(sparse, routers):
        layer.mlp.gate = router
    batch = samples(arch)
    seqs, logps, mismatch, compared = [], [], 0, 0
    by_server = {s: [0, 0] for s in SERVERS}  # (mismatched, compared) pairs of each server's samples
    load = np.zeros((len(routers), arch.num_experts))
    for s in batch:
        for j, router in enumerate(routers):
            router.forced_NK = torch.from_numpy(s.routing[:, j].astype(np.int64)) if replay else None
        logits = model(torch.from_numpy(s.tokens).long()[None]).logits[0, s.prompt_len - 1: len(s.tokens) - 1]
        log_softmax = torch.log_softmax(logits / GSPO.temperature, dim=-1)
        logp = log_softmax.gather(-1, torch.tensor(s.tokens[s.prompt_len:]).long().unsqueeze(-1)).squeeze(-1)
        logps.append(logp.detach())
        seqs.append((logp, torch.tensor(s.behaviour_logprobs)))
        fresh = slice(s.prompt_len - 1, len(s.tokens) - 1)  # the positions that sampled the completion
        for j, router in enumerate(routers):
            vllm = torch.from_numpy(s.routing[fresh, j].astype(np.int64)).sort(-1).values
            differ = int((router.own_NK[fresh].sort(-1).values != vllm).any(-1).sum())
            mismatch += differ
            compared += vllm.shape[0]
            by_server[s.server][0] += differ
            by_server[s.server][1] += vllm.shape[0]
            load[j] += np.bincount(router.used_NK.flatten().numpy(), minlength=arch.num_experts)
    loss = reference_gspo(seqs, torch.tensor([s.advantage for s in batch]), torch.tensor([s.truncated for s in batch]),
                          GSPO.seq_weighting, GSPO.overlong_filtering, eps_low=GSPO.eps_low, eps_high=GSPO.eps_high)
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
    share = load.max(1) / sum(len(s.tokens) for s in batch)
    return {"logp": logps, "loss": loss.item(), "grad_norm": grad_norm.item(), "mismatch": mismatch / compared,
            "compared": compared, "share_mean": share.mean(), "share_max": share.max(), "by_server": by_server}


@pytest.mark.parametrize("replay", [False, True], ids=["free", "replayed"])
def test_ep1_matches_transformers_on_the_same_weights(results, family, replay, tmp_path):
    arch = ARCHS[family]
    ref = _reference(arch, results["initial"], tmp_path, replay)
    ours = results["ep1" if replay else "ep1_free"]
    for i, logp in enumerate(ref["logp"]):
        torch.testing.assert_close(ours["logp"][i], logp, atol=HF_ATOL, rtol=0)
    m = ours["metrics"]
    assert m["train/loss"] == pytest.approx(ref["loss"], abs=HF_ATOL)
    assert m["train/grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert m["train/routing_compared"] == ref["compared"]
    assert m["train/routing_mismatch"] == pytest.approx(ref["mismatch"], abs=1e-9)
    assert 0.5 < ref["mismatch"] < 1  # random routing disagrees with the router's own most of the time
    for server, (differ, pairs) in ref["by_server"].items():  # each server's share, of its own samples' pairs
        key = f"mismatch/server/{server.split('://')[1]}/routing_"
        assert m[key + "compared"] == pairs and m[key + "mismatch"] == pytest.approx(differ / pairs, abs=1e-9)
    assert len({round(differ / pairs, 9) for differ, pairs in ref["by_server"].values()}) == 2  # not one figure
    assert m["moe/busiest_expert_share_mean"] == pytest.approx(ref["share_mean"], abs=1e-6)
    assert m["moe/busiest_expert_share_max"] == pytest.approx(ref["share_max"], abs=1e-6)
