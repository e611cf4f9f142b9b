"""GSPO / GRPO losses against a straightforward per-sequence reference written here."""

import math

import pytest
import torch

from megatron_apriel.trainer.config import LossConfig
from megatron_apriel.trainer.loss import LossInputs, gspo_loss, policy_loss

EPS_LOW, EPS_HIGH = 0.1, 0.15


def make_case():
    """Four sequences of different lengths, ratios chosen to hit both clip bounds, one truncated."""
    lengths = [3, 5, 2, 4]
    # per-sequence mean log-ratio: below 1-eps (A<0 -> clipped), above 1+eps (A>0 -> clipped),
    # inside (unclipped), and a truncated one
    shifts = [math.log(0.7), math.log(1.4), math.log(1.05), math.log(1.3)]
    adv = torch.tensor([-1.0, 0.8, 0.5, 2.0])
    truncated = torch.tensor([False, False, False, True])
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n, shift in zip(lengths, shifts):
        old = -torch.rand(n, generator=g) * 2 - 0.5
        noise = torch.randn(n, generator=g) * 0.05
        noise = noise - noise.mean()
        seqs.append((old + shift + noise, old))
    return seqs, adv, truncated


def flat_inputs(seqs, adv, truncated, pad=2):
    """Lay the sequences out flat with prompt/padding positions (mask False) between them."""
    logp, old, mask, seq = [], [], [], []
    for i, (lp, o) in enumerate(seqs):
        logp += [torch.full((pad,), -9.0), lp]
        old += [torch.zeros(pad), o]
        mask += [torch.zeros(pad, dtype=torch.bool), torch.ones(len(lp), dtype=torch.bool)]
        seq += [torch.full((pad,), 0), torch.full((len(lp),), i)]
    logp_N = torch.cat(logp).clone().requires_grad_(True)
    return LossInputs(logp_N, torch.cat(old), torch.cat(mask), torch.cat(seq), adv, truncated), logp_N


def reference_gspo(seqs, adv, truncated, weighting, filtering, eps_low=EPS_LOW, eps_high=EPS_HIGH):
    total, B = 0.0, len(seqs)
    for (lp, o), a, t in zip(seqs, adv, truncated):
        if filtering and t:
            continue
        n = len(lp)
        s = torch.exp((lp - o).sum() / n)
        term = torch.minimum(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a)
        w = n if weighting == "length" else 1.0
        total = total - w * term
    return total / B


def reference_grpo(seqs, adv, truncated, aggregation):
    total, tokens = 0.0, sum(len(lp) for lp, _ in seqs)
    for (lp, o), a, t in zip(seqs, adv, truncated):
        if t:
            continue
        r = torch.exp(lp - o)
        term = torch.minimum(r * a, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
        total = total - (term.sum() if aggregation == "token_mean" else term.mean())
    return total / (tokens if aggregation == "token_mean" else len(seqs))


def leaf_copies(seqs):
    return [(lp.clone().requires_grad_(True), o) for lp, o in seqs]


def ref_grad(lp):
    """A filtered sequence never enters the reference graph: its gradient is zero."""
    return torch.zeros_like(lp) if lp.grad is None else lp.grad


def grads_by_sequence(inp, logp_N):
    return [logp_N.grad[inp.mask_N & (inp.seq_N == i)] for i in range(len(inp.adv_S))]


@pytest.mark.parametrize("kind", ["gspo", "gspo_token"])
@pytest.mark.parametrize("weighting", ["length", "equal"])
@pytest.mark.parametrize("filtering", [True, False])
def test_gspo_matches_reference(kind, weighting, filtering):
    seqs, adv, truncated = make_case()
    cfg = LossConfig(kind=kind, eps_low=EPS_LOW, eps_high=EPS_HIGH, seq_weighting=weighting,
                     overlong_filtering=filtering)
    inp, logp_N = flat_inputs(seqs, adv, truncated)
    out = policy_loss(inp, cfg)
    (out.loss_sum / out.count).backward()

    ref_seqs = leaf_copies(seqs)
    ref = reference_gspo(ref_seqs, adv, truncated, weighting, filtering)
    ref.backward()
    torch.testing.assert_close(out.loss_sum / out.count, ref.detach(), atol=1e-6, rtol=1e-6)
    for got, (lp, _) in zip(grads_by_sequence(inp, logp_N), ref_seqs):
        torch.testing.assert_close(got, ref_grad(lp), atol=1e-6, rtol=1e-6)
    # prompt/padding positions never receive gradient
    assert torch.all(logp_N.grad[~inp.mask_N] == 0)


def test_case_hits_both_clip_bounds_and_the_mask():
    seqs, adv, truncated = make_case()
    inp, _ = flat_inputs(seqs, adv, truncated)
    out = policy_loss(inp, LossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH))
    # sequences 0 (ratio < 1-eps, A<0) and 1 (ratio > 1+eps, A>0) are clipped; 3 is filtered
    assert out.metrics["clipped"].item() == 2
    assert out.metrics["seqs_filtered"].item() == 1
    assert out.metrics["ratio_min"].item() < 1 - EPS_LOW < 1 + EPS_HIGH < out.metrics["ratio_max"].item()
    # a clipped sequence gets no gradient, an unclipped one does
    inp, logp_N = flat_inputs(seqs, adv, truncated)
    policy_loss(inp, LossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH)).loss_sum.backward()
    g = grads_by_sequence(inp, logp_N)
    assert torch.all(g[0] == 0) and torch.all(g[1] == 0) and torch.all(g[3] == 0)
    assert torch.all(g[2] != 0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_grpo_matches_reference(aggregation):
    seqs, adv, truncated = make_case()
    cfg = LossConfig(kind="grpo", eps_low=EPS_LOW, eps_high=EPS_HIGH, aggregation=aggregation)
    inp, logp_N = flat_inputs(seqs, adv, truncated)
    out = policy_loss(inp, cfg)
    (out.loss_sum / out.count).backward()
    ref_seqs = leaf_copies(seqs)
    ref = reference_grpo(ref_seqs, adv, truncated, aggregation)
    ref.backward()
    torch.testing.assert_close(out.loss_sum / out.count, ref.detach(), atol=1e-6, rtol=1e-6)
    for got, (lp, _) in zip(grads_by_sequence(inp, logp_N), ref_seqs):
        torch.testing.assert_close(got, ref_grad(lp), atol=1e-6, rtol=1e-6)


def test_gspo_and_gspo_token_agree_in_value_and_gradient():
    seqs, adv, truncated = make_case()
    results = []
    for kind in ("gspo", "gspo_token"):
        inp, logp_N = flat_inputs(seqs, adv, truncated)
        out = policy_loss(inp, LossConfig(kind=kind, eps_low=EPS_LOW, eps_high=EPS_HIGH, seq_weighting="equal"))
        out.loss_sum.backward()
        results.append((out.loss_sum.detach(), logp_N.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


def test_splitting_the_batch_does_not_change_the_normalised_loss():
    """Sum of per-part loss_sum over the sum of counts equals the whole batch's loss."""
    seqs, adv, truncated = make_case()
    cfg = LossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH)
    whole = policy_loss(flat_inputs(seqs, adv, truncated)[0], cfg)
    parts = [policy_loss(flat_inputs(seqs[a:b], adv[a:b], truncated[a:b])[0], cfg) for a, b in ((0, 1), (1, 4))]
    total = sum(p.loss_sum for p in parts) / sum(p.count for p in parts)
    torch.testing.assert_close(total, whole.loss_sum / whole.count)


def test_gspo_loss_rejects_grpo_and_bad_config():
    with pytest.raises(ValueError, match="policy_loss"):
        seqs, adv, truncated = make_case()
        gspo_loss(flat_inputs(seqs, adv, truncated)[0], LossConfig(kind="grpo"))
    with pytest.raises(ValueError, match="loss.kind"):
        LossConfig(kind="ppo2")
    with pytest.raises(ValueError, match="eps_low"):
        LossConfig(eps_low=1.5)
