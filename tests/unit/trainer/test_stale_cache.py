"""``fleet.kv_on_update=keep`` from the record to the step's figures: a model token sampled by newer
weights than its context's KV cache (``Rollout.context_versions`` below ``versions``) is marked
stale-cache; it is never counted fresh (so neither the per-server drift nor the drift gate sees it),
and the mismatch figures report it apart (``mismatch/fresh_stale_cache/*``), each figure equal to a
direct count over the tokens of its class. A record without context versions (recompute, schemas
before 5) marks nothing."""

import numpy as np
import pytest
import torch

from megatron_apriel.records.rollouts import RolloutGroup, VersionSpan
from megatron_apriel.trainer.batch import packed_microbatches, padded_microbatches
from megatron_apriel.trainer.config import LossConfig
from megatron_apriel.trainer.loss import LossInputs, finalize_mismatch, policy_loss
from megatron_apriel.trainer.mismatch import fresh_drift_by_sequence
from tests.unit.records.test_trajectories import multi_turn_group, multi_turn_rollout

# multi_turn_rollout's 6 model tokens in 3 turns: tokens 0-2, 3-4, 5. Here turn 1 is sampled by v2,
# turn 2 by v3 (the update came while its request, salted v2, waited: kept, its cache is v2's), turn 3
# by v3 from a request salted v3: tokens 3 and 4 are sampled over a stale cache, token 5 is not.
VERSIONS = [(2, 0, 3), (3, 3, 6)]
CONTEXT = [(2, 0, 5), (3, 5, 6)]
STALE_CACHE = [False, False, False, True, True, False]


def spans(rows):
    return [VersionSpan(version=v, start=a, end=b) for v, a, b in rows]


def kept_rollout():
    return multi_turn_rollout(versions=spans(VERSIONS), context_versions=spans(CONTEXT))


def test_stale_cache_tokens_are_those_sampled_by_newer_weights_than_their_context():
    r = kept_rollout()
    assert r.stale_cache().tolist() == STALE_CACHE
    assert multi_turn_rollout().stale_cache() is None  # recompute, or a stream before schema 5
    g = multi_turn_group()
    g = RolloutGroup.model_validate({**g.model_dump(), "rollouts": [r.model_dump(), g.rollouts[1].model_dump()]})
    back = RolloutGroup.model_validate_json(g.model_dump_json())
    assert back.schema_version == 5 and back.rollouts[0].context_versions == r.context_versions
    assert back.train_sample(0, version=5).stale_cache.tolist() == STALE_CACHE
    assert back.train_sample(1, version=5).stale_cache is None
    with pytest.raises(ValueError, match="context version spans .* do not cover the 6 model tokens"):
        multi_turn_rollout(context_versions=[VersionSpan(version=2, start=0, end=4)])


def test_a_schema_4_group_reads_without_context_versions():
    old = multi_turn_group().model_dump(mode="json")
    old["schema_version"] = 4
    for r in old["rollouts"]:
        del r["context_versions"]
    g = RolloutGroup.model_validate(old)
    assert all(r.context_versions == [] and r.stale_cache() is None for r in g.rollouts)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_stale_cache_tokens_are_not_fresh_and_their_mismatch_is_reported_apart(layout):
    g = multi_turn_group()
    g = RolloutGroup.model_validate({**g.model_dump(), "rollouts": [kept_rollout().model_dump(),
                                                                    g.rollouts[1].model_dump()]})
    version = 3  # trained: tokens 0-2 (v2) are stale, 3-4 fresh over a stale cache, 5 fresh; the other rollout v0
    samples = [g.train_sample(i, version) for i in range(2)]
    mbs = (padded_microbatches(samples, [0, 1], 2, 24) if layout == "padded"
           else packed_microbatches(samples, [0, 1], 40))
    totals, fresh_seen, stale_cache_seen = {}, 0, 0
    rng = np.random.default_rng(1)
    for mb in mbs:
        logp = torch.where(mb.loss_mask, torch.tensor(rng.normal(size=mb.loss_mask.shape) * 0.1 - 1.0), 0.0)
        inp = LossInputs(logp.flatten(), mb.old_logp.double().flatten(), mb.loss_mask.flatten(), mb.seq.flatten(),
                         mb.advantages.double(), mb.truncated, fresh_N=mb.fresh.flatten(), lag_N=mb.lag.flatten(),
                         stale_cache_N=mb.stale_cache.flatten())
        out = policy_loss(inp, LossConfig())
        for k, v in out.metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        # the direct counts: |log rho| over each class of this micro-batch's loss tokens
        log_rho = (logp - mb.old_logp.double()).abs()
        truly_fresh = mb.loss_mask & (mb.lag == 0) & ~mb.stale_cache
        over_stale = mb.loss_mask & (mb.lag == 0) & mb.stale_cache
        assert torch.equal(mb.fresh, truly_fresh)  # a stale-cache token is never fresh
        fresh_seen += int(truly_fresh.sum())
        stale_cache_seen += int(over_stale.sum())
        totals.setdefault("ref_fresh", 0.0)
        totals["ref_fresh"] += float(log_rho[truly_fresh].sum())
        totals.setdefault("ref_cache", 0.0)
        totals["ref_cache"] += float(log_rho[over_stale].sum())
        drift = fresh_drift_by_sequence(inp)
        assert float(drift[:, 1].sum()) == int(truly_fresh.sum())  # the per-server drift counts fresh tokens only
    assert (fresh_seen, stale_cache_seen) == (1, 2)
    figures = finalize_mismatch(totals)
    assert figures["mismatch/fresh/tokens"] == 1 and figures["mismatch/fresh_stale_cache/tokens"] == 2
    assert figures["mismatch/fresh/abs_log_rho"] == pytest.approx(totals["ref_fresh"])
    assert figures["mismatch/fresh_stale_cache/abs_log_rho"] == pytest.approx(totals["ref_cache"] / 2)
    assert figures["mismatch/stale/tokens"] == 3 + 5  # tokens 0-2, and the v0 rollout's 5
    assert figures["mismatch/all/tokens"] == sum(s.model_length for s in samples)


def test_without_stale_cache_tokens_there_is_no_such_figure():
    g = multi_turn_group()
    samples = [g.train_sample(i, 5) for i in range(2)]
    [mb] = padded_microbatches(samples, [0, 1], 2, 24)
    assert not mb.stale_cache.any()
    logp = torch.where(mb.loss_mask, -1.0, 0.0).double()
    inp = LossInputs(logp.flatten(), mb.old_logp.double().flatten(), mb.loss_mask.flatten(), mb.seq.flatten(),
                     mb.advantages.double(), mb.truncated, fresh_N=mb.fresh.flatten(), lag_N=mb.lag.flatten(),
                     stale_cache_N=mb.stale_cache.flatten())
    figures = finalize_mismatch({k: float(v) for k, v in policy_loss(inp, LossConfig()).metrics.items()})
    assert not any("stale_cache" in k for k in figures) and figures["mismatch/fresh/tokens"] == 1
