"""Multi-turn masks from the sample to the loss: padded, packed and CP-aligned micro-batches of
trajectories whose environment tokens sit between the model's turns give the loss and gradients of a
reference that leaves those tokens out (fp64); the environment's tokens get no gradient, no drift and
no mismatch figure."""

import dataclasses

import numpy as np
import pytest
import torch

from megatron_apriel.records.samples import TrainSample
from megatron_apriel.trainer.batch import packed_microbatches, padded_microbatches
from megatron_apriel.trainer.config import LossConfig
from megatron_apriel.trainer.loss import LossInputs, finalize_metrics, policy_loss
from megatron_apriel.trainer.mismatch import fresh_drift_by_sequence
from tests.unit.trainer.test_loss import EPS_HIGH, EPS_LOW, reference_grpo, reference_gspo

# (prompt, [(model tokens, environment tokens after them), ...]) per trajectory; one single-turn
SHAPES = [(3, [(4, 3), (2, 5), (3, 0)]), (2, [(5, 0)]), (4, [(1, 2), (6, 0)]), (2, [(3, 4), (2, 0)])]
ADV = [0.75, -1.25, 1.5, -0.375]  # exact in float32, as the micro-batch holds them
SHIFTS = [np.log(1.4), np.log(0.7), np.log(1.05), np.log(1.3)]  # mean log-ratio: above, below, inside the clip
ENV_LOGP = -25.0  # what the policy gives a tool's output: any of it in the loss would dominate


def trajectories(truncated_last: bool = True):
    """The samples and, per sample, the policy's log-prob of each sequence position's next token
    (``[len(tokens)]`` fp64: -25 where the next token is the environment's)."""
    g = np.random.default_rng(0)
    samples, policy = [], []
    for i, (plen, turns) in enumerate(SHAPES):
        mask = np.concatenate([np.r_[np.ones(m, bool), np.zeros(e, bool)] for m, e in turns])
        n = plen + len(mask)
        full = np.full(n, -7.0)  # positions that predict no completion token (the prompt's, the last)
        full[plen - 1 : n - 1] = np.where(mask, -g.random(len(mask)) * 2 - 0.5, ENV_LOGP + g.random(len(mask)))
        model_logp = full[plen - 1 : n - 1][mask]
        noise = g.normal(size=mask.sum()) * 0.05
        old = (model_logp - SHIFTS[i] - (noise - noise.mean())).astype(np.float32)
        lags = np.arange(mask.sum()) % 2  # fresh and stale model tokens
        samples.append(TrainSample(g.integers(0, 100, n), plen, old, ADV[i], mask=None if mask.all() else mask,
                                   truncated=truncated_last and i == len(SHAPES) - 1, lags=lags))
        policy.append(full)
    return samples, policy


def microbatches(samples, layout):
    ids = list(range(len(samples)))
    if layout == "padded":
        return padded_microbatches(samples, ids, 3, 24)
    return packed_microbatches(samples, ids, 24 if layout == "packed" else 28, align=1 if layout == "packed" else 4)


def loss_inputs(mb, leaves):
    """The micro-batch's flat inputs, with ``logp_N`` gathered (differentiably) from the samples'
    per-position leaves by sequence and position id."""
    flat = torch.cat(leaves)
    offsets = torch.tensor(np.cumsum([0] + [len(leaf) for leaf in leaves])[:-1])
    sid = torch.tensor(mb.sample_ids)[mb.seq.clamp(0, len(mb.sample_ids) - 1)]
    at = (offsets[sid] + mb.position_ids).clamp(max=len(flat) - 1)
    logp = torch.where(mb.valid, flat[at], 0.0)
    return LossInputs(logp.flatten(), mb.old_logp.double().flatten(), mb.loss_mask.flatten(), mb.seq.flatten(),
                      mb.advantages.double(), mb.truncated, fresh_N=mb.fresh.flatten(), lag_N=mb.lag.flatten())


def reference(samples, policy, cfg):
    """The loss on the model's tokens alone, written per sequence (test_loss.py's references)."""
    leaves = [torch.tensor(p, requires_grad=True) for p in policy]
    seqs = [(leaf[s.prompt_len - 1 : -1][torch.from_numpy(s.completion_mask())],
             torch.from_numpy(s.behaviour_logprobs).double()) for s, leaf in zip(samples, leaves)]
    adv = torch.tensor(ADV, dtype=torch.float64)
    truncated = torch.tensor([s.truncated for s in samples])
    if cfg.kind == "grpo":
        loss = reference_grpo(seqs, adv, truncated, cfg.aggregation)
    else:
        loss = reference_gspo(seqs, adv, truncated, cfg.seq_weighting, cfg.overlong_filtering)
    loss.backward()
    return loss.detach(), [torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for leaf in leaves]


CONFIGS = [LossConfig(kind="gspo", seq_weighting="length"), LossConfig(kind="gspo", seq_weighting="equal"),
           LossConfig(kind="gspo_token"), LossConfig(kind="grpo", aggregation="token_mean"),
           LossConfig(kind="grpo", aggregation="seq_mean_token_mean")]


@pytest.mark.parametrize("layout", ["padded", "packed", "packed_cp_aligned"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.kind}_{c.seq_weighting}_{c.aggregation}")
def test_the_loss_and_gradients_of_a_multi_turn_batch_leave_the_environment_tokens_out(layout, cfg):
    cfg = dataclasses.replace(cfg, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    samples, policy = trajectories()
    leaves = [torch.tensor(p, requires_grad=True) for p in policy]
    outs = [policy_loss(loss_inputs(mb, leaves), cfg) for mb in microbatches(samples, layout)]
    loss = sum(o.loss_sum for o in outs) / sum(o.count for o in outs)
    loss.backward()
    want, want_grads = reference(samples, policy, cfg)
    torch.testing.assert_close(loss.detach(), want, atol=1e-12, rtol=1e-12)
    for leaf, grad, s in zip(leaves, want_grads, samples):
        torch.testing.assert_close(leaf.grad, grad, atol=1e-12, rtol=1e-12)
        env = np.flatnonzero(~s.completion_mask()) + s.prompt_len - 1
        assert torch.all(leaf.grad[env] == 0)
    assert any(g.abs().sum() > 0 for g in want_grads)  # the case is not trivially zero


def test_only_the_model_tokens_are_counted_drifted_and_mismatched():
    samples, policy = trajectories(truncated_last=False)
    leaves = [torch.tensor(p) for p in policy]
    totals, drift = {}, np.zeros(2)
    for mb in microbatches(samples, "packed"):
        inp = loss_inputs(mb, leaves)
        for k, v in policy_loss(inp, LossConfig(correction="token_tis")).metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        drift += fresh_drift_by_sequence(inp).sum(0).numpy()
    figures = finalize_metrics({**totals, "ratio_min": 0.0, "ratio_max": 0.0})
    model = [(p[s.prompt_len - 1 : -1][s.completion_mask()], s) for p, s in zip(policy, samples)]
    log_rho = np.concatenate([lp - s.behaviour_logprobs for lp, s in model])
    fresh = np.concatenate([s.lags == 0 for s in samples])
    assert figures["train/tokens"] == figures["mismatch/all/tokens"] == len(log_rho) == 26
    assert figures["mismatch/all/abs_log_rho"] == pytest.approx(np.abs(log_rho).mean())
    assert figures["mismatch/fresh/tokens"] == fresh.sum() and drift[1] == fresh.sum()
    assert drift[0] == pytest.approx(np.abs(log_rho[fresh]).sum())
    assert figures["train/abs_log_ratio"] == pytest.approx(np.abs(log_rho).mean())


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_fresh_positions_are_the_model_tokens_of_lag_0_only(layout):
    """The MoE routing taps compare the router with vLLM on ``fresh`` positions alone (model.routing):
    an environment token is never one, whatever its (unused) lag."""
    samples, _ = trajectories()
    for mb in microbatches(samples, layout):
        assert torch.equal(mb.fresh, mb.loss_mask & (mb.lag == 0))
        assert (mb.valid & ~mb.loss_mask & (mb.lag == 0)).any()  # environment positions, lag 0, not fresh
