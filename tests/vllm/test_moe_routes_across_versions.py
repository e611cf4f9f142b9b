"""Routing replay for a completion that spans two weight versions (docs/moe.md, "A completion that
spans two weight versions"), on a real vLLM: a tiny Qwen3-MoE served by apriel-serve with
``--return-routed-experts``, new weights pushed by an expert-parallel trainer (EP 2, each rank its
own experts) while long requests decode. Each position's recorded route is the one of the last
forward that computed it; the weight update pauses the engine with ``/pause?mode=keep``, and:

- ``fleet.kv_on_update=recompute`` (``clear_cache=true``): vLLM resets the running requests (vLLM
  0.32: ``EngineCore._reset_caches(reset_running_requests=True)``), which after the update compute
  their whole prefix again with the new weights. A completion that spans the update carries the new
  weights' routes at every position, the prompt and the tokens sampled before the update included.
  The reference is transformers with the new weights over the whole sequence.
- ``keep`` (``clear_cache=false``): the running requests keep their cache. The positions computed
  before the update keep the old weights' routes; the later ones are the new weights' over the old
  weights' keys and values. The reference is transformers with the old weights over the prefix,
  then the new weights continuing from the old weights' cache.
"""

import os
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from megatron_apriel.parallel.rendezvous import free_port
from megatron_apriel.records.weights import parse_version_label
from tests.vllm.test_weight_sync_vllm import ROOT, start_held_requests, start_pusher, wait_for

sys.path.insert(0, str(ROOT / "tests" / "dist"))
from weight_sync_push import base_canonical, perturbed  # noqa: E402

pytestmark = pytest.mark.vllm
REQUESTS = 4


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    from megatron_apriel.fleet.registry import start_server
    from megatron_apriel.tiny.model import TinySpec, build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), TinySpec(num_experts=4))
    server = start_server(str(model), free_port(), tmp_path_factory.mktemp("moe_vllm") / "server.log",
                          extra_args=["--max-model-len", "512", "--max-num-seqs", "8", "--return-routed-experts"])
    try:
        server.wait_healthy(timeout_s=240)
        yield server, model
    finally:
        server.stop()


def push_during_requests(url: str, model: Path, work: Path, version: int, kv: str) -> list:
    """EP 2 pushes the weights of ``version`` while ``REQUESTS`` long requests decode."""
    extra = ["--keep-kv"] if kv == "keep" else []
    proc = start_pusher("ep2", url, str(model), work, version, "--pushes", "1", *extra)
    try:
        wait_for(work / "ready", proc)
        completions: list = []
        thread = start_held_requests(url, REQUESTS, completions)
        (work / "go1").touch()
        wait_for(work / "done1", proc)
        thread.join(120)
        assert torch.load(work / "step1.pt")["report"]["accepted"]
        assert proc.wait(60) == 0, proc.stdout.read()[-4000:]
        return completions
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


def install_routers(model) -> list:
    from tests.unit.trainer.test_moe_layouts import _Router

    routers = []
    for layer in model.model.layers:
        routers.append(_Router(layer.mlp.gate.weight, model.config.num_experts_per_tok, model.config.norm_topk_prob))
        layer.mlp.gate = routers[-1]
    return routers


def routes(routers: list) -> np.ndarray:
    """``[positions, layers, k]``: each router's sorted top-k of its last forward."""
    return np.stack([r.own_NK.sort(-1).values.numpy() for r in routers], axis=1)


def hf_routes(model, tokens: list[int]) -> np.ndarray:
    """``[len(tokens) - 1, layers, k]`` sorted top-k experts of each position under ``model``."""
    routers = install_routers(model)
    with torch.no_grad():
        model(torch.tensor(tokens[:-1])[None])  # the last token was sampled, never run
    return routes(routers)


def hf_routes_over_kept_cache(old, new, tokens: list[int], before: int) -> np.ndarray:
    """As vLLM computes them under ``keep``: positions ``[0, before)`` by ``old``; the rest by ``new``,
    attending over the keys and values ``old`` computed for the first ``before``."""
    old_routers, new_routers = install_routers(old), install_routers(new)
    with torch.no_grad():
        cache = old(torch.tensor(tokens[:before])[None], use_cache=True).past_key_values
        new(torch.tensor(tokens[before:-1])[None], past_key_values=cache, use_cache=True)
    return np.concatenate([routes(old_routers), routes(new_routers)])


def weights_of(base: dict, version: int) -> dict:
    """The canonical weights the server held as ``version`` (0: the checkpoint it started from)."""
    return base if version == 0 else perturbed(base, version)


@pytest.mark.parametrize("kv, version", [("recompute", 1), ("keep", 2)])
def test_a_completion_spanning_an_update_carries_the_routes_of_the_forward_that_computed_each_position(
        kv, version, moe_server, tmp_path):
    from megatron_apriel.model import ModelArch
    from tests.unit.trainer.test_moe_layouts import _hf_model

    server, model = moe_server
    previous = parse_version_label(httpx.get(server.url + "/weight_info").json()["weight_version"])
    completions = push_during_requests(server.url, model, tmp_path, version, kv)
    spanning = [c for c in completions if c.versions_seen == sorted({previous, version})]
    assert spanning, [c.versions for c in completions]

    arch = ModelArch.from_hf_dir(str(model))
    base, _ = base_canonical(str(model), arch)
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old_model = _hf_model(arch, weights_of(base, previous), tmp_path / "old")  # each call below puts fresh
    new_model = _hf_model(arch, weights_of(base, version), tmp_path / "new")  # recording routers in
    moved = 0
    for i, c in enumerate(spanning):
        tokens = c.prompt_token_ids + c.token_ids
        got = np.sort(c.routed_experts.array().astype(np.int64), axis=-1)
        assert got.shape[0] == len(tokens) - 1
        before = len(c.prompt_token_ids) + c.versions[1].start - 1  # positions the old weights computed first
        new = hf_routes(new_model, tokens)
        want = new if kv == "recompute" else hf_routes_over_kept_cache(old_model, new_model, tokens, before)
        differs = (got != want).any(-1)  # [positions, layers]
        assert not differs.any(), f"completion {i} ({c.versions}, {kv}): {int(differs.sum())} (position, layer) " \
                                  f"routes differ from the reference, first at {np.argwhere(differs)[:5].tolist()}"
        # the update moved routes of positions the old weights had computed (so the two policies differ
        # there: recompute records the new weights' routes, keep the old ones)
        old = hf_routes(old_model, tokens)
        moved += int((old[:before] != new[:before]).any(-1).sum())
    assert moved > 0
