"""Mismatch corrections (loss.correction) against a reference written here from RECIPE.md section 10,
loss and gradients, with tokens and sequences whose weight sits exactly at C, low and high; and
the mismatch figures against a direct count."""

import math
import threading

import pytest
import torch

from megatron_apriel.trainer.config import LossConfig
from megatron_apriel.trainer.loss import LossInputs, finalize_metrics, policy_loss
from tests.unit.trainer.test_loss import grads_by_sequence

C, LOW, HIGH = 2.0, 0.5, 2.0
# log rho_t per token of each sequence (behaviour log-prob 0, so log pi_t = log rho_t exactly):
LOG_RHO = [
    [math.log(2.0), math.log(2.0)],  # every token at C = high: geometric mean exactly C
    [math.log(0.5), math.log(0.5), math.log(0.5), math.log(0.5)],  # every token at low
    [math.log(2.5), math.log(0.1), 0.3, -0.2, math.log(1.0)],  # one above C, one below low
    [math.log(3.0), math.log(3.0), math.log(3.0)],  # geometric mean 3 > C
    [math.log(0.4), 0.1],  # one below low; geometric mean ~0.70, inside
    [0.2, -0.1, math.log(5.0)],  # truncated: no loss whatever the correction
]
ADV = torch.tensor([1.0, -0.5, 0.8, 2.0, -1.5, 1.0], dtype=torch.float64)
TRUNC = torch.tensor([False, False, False, False, False, True])
LAGS = [[0, 0], [1, 1, 1, 1], [0, 0, 0, 2, 2], [3, 4, 5], [0, 1], [0, 0, 0]]
CORRECTIONS = ["token_tis", "seq_tis", "seq_is", "token_mask", "seq_mask"]


def config(correction: str, anchor: str = "current", **kw) -> LossConfig:
    """The case's bounds at both levels: C, low and high for tokens; low, high (the geometric cap)
    and C (the product's) for sequences."""
    return LossConfig(correction=correction, correction_anchor="behaviour" if correction == "none" else anchor,
                      correction_clip=C, correction_low=LOW, correction_high=HIGH, correction_seq_low=LOW,
                      correction_seq_high=HIGH, correction_seq_clip=C, **kw)


def test_the_case_sits_exactly_on_the_bounds():
    rho = [torch.tensor(x, dtype=torch.float64).exp() for x in LOG_RHO]
    assert rho[0][0].item() == C and rho[1][0].item() == LOW  # exactly, not within round-off
    assert rho[0].log().mean().exp().item() == C and rho[1].log().mean().exp().item() == LOW


def make_inputs(pad=2):
    """Sequences laid out flat with loss-free positions between them (log-probs of the old policy 0)."""
    logp, mask, seq, lag = [], [], [], []
    for i, (xs, lags) in enumerate(zip(LOG_RHO, LAGS)):
        logp += [-7.0] * pad + xs
        mask += [False] * pad + [True] * len(xs)
        seq += [0] * pad + [i] * len(xs)
        lag += [9] * pad + lags
    logp_N = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    inp = LossInputs(logp_N, torch.zeros_like(logp_N.detach()), torch.tensor(mask), torch.tensor(seq), ADV, TRUNC,
                     lag_N=torch.tensor(lag))
    return inp, logp_N


def reference_weights(correction: str, xs: list[float]) -> tuple[float, list[float]]:
    """(w_i, [w_t]) from the formulas: rho_t = pi_t / mu_t, g_i = exp(mean_t log rho_t)."""
    rho = [math.exp(x) for x in xs]
    g = math.exp(sum(xs) / len(xs))
    if correction == "token_tis":
        return 1.0, [min(r, C) for r in rho]
    if correction == "seq_tis":
        return min(g, HIGH), [1.0] * len(rho)
    if correction == "seq_is":
        return min(math.exp(sum(xs)), C), [1.0] * len(rho)
    if correction == "token_mask":
        return 1.0, [r if LOW <= r <= HIGH else 0.0 for r in rho]
    return (1.0 if LOW <= g <= HIGH else 0.0), [min(r, C) for r in rho]  # seq_mask


def reference_loss(correction: str, kind: str, seq_weighting: str, anchor: str = "current", eps: float = 0.2):
    """The decoupled loss, each term carrying the correction's weights. current: the ratio is
    pi / sg[pi] (1 in value, so no clip binds); GSPO: -(1/B) sum_i v_i w_i mean_t w_t r_t A_i
    (v_i = n_i or 1); DAPO token_mean: -(1/T) sum_i sum_t w_i w_t r_t A_i. behaviour: the ratio is
    pi / mu (token r_t for DAPO; s_i = exp(mean_t log(pi_t / mu_t)) for GSPO, in its token form),
    clipped at [1 - eps, 1 + eps] as the recipe, and each weight divided by that ratio's value (rho_t,
    or g_i). Truncated sequences carry no loss."""
    leaves = [torch.tensor(xs, dtype=torch.float64, requires_grad=True) for xs in LOG_RHO]
    total = torch.zeros((), dtype=torch.float64)
    tokens = sum(len(xs) for xs in LOG_RHO)
    for lp, xs, a, t in zip(leaves, LOG_RHO, ADV, TRUNC):
        if t:
            continue
        w_seq, w_tok = reference_weights(correction, xs)
        w = torch.tensor(w_tok, dtype=torch.float64) * w_seq
        x = torch.tensor(xs, dtype=torch.float64)  # log rho_t (mu's log-probs are 0)
        if anchor == "current":
            terms = w * torch.exp(lp - lp.detach()) * a
        elif kind == "grpo":
            r = torch.exp(lp - lp.detach() + x)
            terms = w / x.exp() * torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a)
        else:
            log_s = (lp - lp.detach() + x).mean()
            s = torch.exp(log_s.detach() + lp - lp.detach())
            terms = w / x.mean().exp() * torch.minimum(s * a, s.clamp(1 - eps, 1 + eps) * a)
        if kind == "grpo":
            total = total - terms.sum() / tokens
        else:
            v = len(xs) if seq_weighting == "length" else 1.0
            total = total - v * terms.mean() / len(LOG_RHO)
    total.backward()
    return total.detach(), [torch.zeros(len(xs), dtype=torch.float64) if lp.grad is None else lp.grad
                            for lp, xs in zip(leaves, LOG_RHO)]


@pytest.mark.parametrize("anchor", ["current", "behaviour"])
@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("kind, weighting", [("gspo", "length"), ("gspo", "equal"), ("gspo_token", "length"),
                                             ("grpo", "length")])
def test_each_correction_matches_the_reference_in_loss_and_gradient(correction, kind, weighting, anchor):
    cfg = config(correction, anchor, kind=kind, seq_weighting=weighting, eps_low=0.2, eps_high=0.2)
    inp, logp_N = make_inputs()
    out = policy_loss(inp, cfg)
    (out.loss_sum / out.count).backward()
    ref, ref_grads = reference_loss(correction, kind, weighting, anchor)
    torch.testing.assert_close(out.loss_sum.detach() / out.count, ref, atol=1e-12, rtol=1e-12)
    for got, want in zip(grads_by_sequence(inp, logp_N), ref_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert torch.all(logp_N.grad[~inp.mask_N] == 0)


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("kind", ["gspo", "grpo"])
def test_on_the_behaviour_anchor_the_clip_keeps_its_trust_region(correction, kind):
    """correction_anchor=behaviour: the gradient is the current form's wherever the recipe's clip on
    pi / mu does not bind, and 0 where it binds (per sequence for GSPO, per token for DAPO)."""
    grads = {}
    for anchor in ("current", "behaviour"):
        inp, logp_N = make_inputs()
        out = policy_loss(inp, config(correction, anchor, kind=kind, eps_low=0.2, eps_high=0.2))
        out.loss_sum.backward()
        grads[anchor] = grads_by_sequence(inp, logp_N)
    bound = 0
    for xs, a, current, behaviour in zip(LOG_RHO, ADV, grads["current"], grads["behaviour"]):
        ratio = torch.tensor(xs, dtype=torch.float64).exp()
        if kind == "gspo":
            ratio = ratio.log().mean().exp().expand(len(xs))
        clipped = ((a > 0) & (ratio > 1.2)) | ((a < 0) & (ratio < 0.8))
        bound += int(clipped.sum())
        assert torch.all(behaviour[clipped] == 0)
        torch.testing.assert_close(behaviour[~clipped], current[~clipped], atol=1e-12, rtol=1e-12)
    assert bound > 0  # the case has ratios beyond the clip on both sides


# what each correction cuts, counted by hand from LOG_RHO (the truncated sequence 5 counts too: the
# figures describe the stream, overlong filtering aside): tokens above C (2.5, 3, 3, 3, 5), tokens
# outside [0.5, 2] (2.5, 0.1, 3, 3, 3, 0.4, 5), sequences whose geometric mean is above C (3 and 5's
# exp((0.2 - 0.1 + log 5) / 3) = 1.86: only 3) or outside [0.5, 2] (only 3)
HAND_CUT = {"token_tis": (5, 0), "seq_tis": (3, 1), "seq_is": (8, 3), "token_mask": (7, 0), "seq_mask": (5, 1),
            "none": (0, 0)}


@pytest.mark.parametrize("correction", [*CORRECTIONS, "none"])
def test_the_cut_shares_are_the_hand_counts(correction):
    """Every token of a sequence that a sequence-level correction truncated (seq_tis: sequence 3; seq_is:
    the products 4, 27 and 5.5 above C, sequences 0, 3 and 5) or masked (seq_mask: sequence 3) counts
    as cut, beside the tokens the token level cut."""
    inp, _ = make_inputs()
    out = policy_loss(inp, config(correction))
    figures = finalize_metrics(_totals(out.metrics))
    tokens, seqs = sum(map(len, LOG_RHO)), len(LOG_RHO)
    cut_tokens, cut_seqs = HAND_CUT[correction]
    assert figures["mismatch/all/cut_share"] == pytest.approx(cut_tokens / tokens)
    assert figures["mismatch/seqs_cut_share"] == pytest.approx(cut_seqs / seqs)


def test_mismatch_figures_split_fresh_stale_and_per_lag():
    inp, _ = make_inputs()
    figures = finalize_metrics(_totals(policy_loss(inp, LossConfig()).metrics))
    by_lag: dict[int, list[float]] = {}
    for xs, lags in zip(LOG_RHO, LAGS):
        for x, lag in zip(xs, lags):
            by_lag.setdefault(min(lag, 3), []).append(x)

    def expect(name, xs):
        assert figures[f"mismatch/{name}/tokens"] == len(xs)
        assert figures[f"mismatch/{name}/abs_log_rho"] == pytest.approx(sum(abs(x) for x in xs) / len(xs))
        k3 = sum(math.exp(x) - 1 - x for x in xs) / len(xs)
        assert figures[f"mismatch/{name}/kl_k3"] == pytest.approx(k3) and k3 > 0

    expect("fresh", by_lag[0])
    expect("stale", by_lag[1] + by_lag[2] + by_lag[3])
    expect("lag1", by_lag[1])
    expect("lag2", by_lag[2])
    expect("lag3+", by_lag[3])
    expect("all", [x for xs in LOG_RHO for x in xs])


def _totals(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()}


def test_split_sequences_give_the_unsplit_weights():
    """Context parallelism: two ranks each hold part of every sequence; the sequence-level weights
    (geometric mean of rho) are summed over both, so the two loss_sums add up to the whole loss."""
    cfg = config("seq_mask", kind="gspo")
    whole_inp, _ = make_inputs(pad=0)
    whole = policy_loss(whole_inp, cfg)
    halves = [torch.arange(len(whole_inp.logp_N)) % 2 == r for r in range(2)]
    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def all_reduce(rank: int, t: torch.Tensor) -> torch.Tensor:  # a two-rank sum, as dist.all_reduce
        slots[rank] = t.clone()
        barrier.wait()
        total = slots[0] + slots[1]
        barrier.wait()
        return total

    def rank_loss(rank: int) -> None:
        part = halves[rank]
        inp = LossInputs(whole_inp.logp_N[part], whole_inp.old_logp_N[part], whole_inp.mask_N[part],
                         whole_inp.seq_N[part], ADV, TRUNC, lag_N=whole_inp.lag_N[part],
                         seq_total=lambda t: all_reduce(rank, t), counts_sequences=rank == 0)
        results[rank] = policy_loss(inp, cfg)

    threads = [threading.Thread(target=rank_loss, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(results[0].loss_sum + results[1].loss_sum, whole.loss_sum)
    assert int(results[0].count + results[1].count) == int(whole.count)
    summed = {k: float(results[0].metrics[k] + results[1].metrics[k]) for k in whole.metrics
              if k.startswith("mm_")}
    assert summed == pytest.approx({k: float(v) for k, v in whole.metrics.items() if k.startswith("mm_")})


def test_bad_correction_settings_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="loss.correction"):
        LossConfig(correction="tis")
    with pytest.raises(ValueError, match="correction_low"):
        LossConfig(correction="token_mask", correction_low=1.5)
    with pytest.raises(ValueError, match="correction_clip"):
        LossConfig(correction_clip=0.0)
    with pytest.raises(ValueError, match="correction_seq_high must be in|correction_seq_high >= 1"):
        LossConfig(correction="seq_mask", correction_seq_high=0.999)
    with pytest.raises(ValueError, match="correction_seq_clip"):
        LossConfig(correction="seq_is", correction_seq_clip=-1.0)
    with pytest.raises(ValueError, match="loss.correction_anchor"):
        LossConfig(correction="token_tis", correction_anchor="mu")
    with pytest.raises(ValueError, match="set loss.correction_anchor=behaviour"):
        LossConfig(correction_anchor="current")  # correction=none: nothing to anchor
    with pytest.raises(ValueError, match="loss.correction_count"):
        LossConfig(correction="token_mask", correction_count="some")


def test_the_sequence_level_has_its_own_bounds_near_1():
    """The defaults: the peers' geometric bounds for sequences, IcePop's and TIS's for tokens."""
    cfg = LossConfig(correction="seq_mask")
    assert (cfg.correction_seq_low, cfg.correction_seq_high, cfg.correction_seq_clip) == (0.99, 1.01, 2.0)
    assert (cfg.correction_low, cfg.correction_high, cfg.correction_clip) == (0.5, 2.0, 2.0)
    assert cfg.correction_anchor == "behaviour" and cfg.correction_count == "all"
    # a geometric mean of 1.02 (mean log rho 0.02 nats) is masked by default; [0.5, 2] kept it
    inp = LossInputs(torch.full((4,), 0.02, dtype=torch.float64), torch.zeros(4, dtype=torch.float64),
                     torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.long),
                     torch.tensor([1.0], dtype=torch.float64), torch.tensor([False]))
    out = policy_loss(inp, cfg)
    assert out.loss_sum.item() == 0 and float(out.metrics["mm_seqs_cut"]) == 1


@pytest.mark.parametrize("kind", ["gspo", "grpo"])
def test_with_the_current_anchor_the_ratio_figures_are_against_mu(kind):
    """The loss's own ratio is 1 there; train/ratio_* and train/clip_fraction report what the recipe's
    clip would see: the ratio against mu (g_i per sequence for GSPO, rho_t per token for DAPO)."""
    inp, _ = make_inputs()
    figures = finalize_metrics(_totals(policy_loss(inp, config("token_tis", kind=kind, eps_low=0.2,
                                                                   eps_high=0.2)).metrics))
    kept = [(xs, a) for xs, a, t in zip(LOG_RHO, ADV.tolist(), TRUNC.tolist()) if not t]
    if kind == "gspo":
        ratios = [(math.exp(sum(xs) / len(xs)), a) for xs, a in kept]
    else:
        ratios = [(math.exp(x), a) for xs, a in kept for x in xs]
    clipped = sum((a > 0 and r > 1.2) or (a < 0 and r < 0.8) for r, a in ratios)
    assert figures["train/ratio_mean"] == pytest.approx(sum(r for r, _ in ratios) / len(ratios))
    assert figures["train/ratio_max"] == pytest.approx(max(r for r, _ in ratios))
    assert figures["train/clip_fraction"] == pytest.approx(clipped / len(ratios)) and clipped > 0


def test_kept_leaves_what_a_mask_dropped_out_of_the_denominators():
    """correction_count=kept (verl): token_mask's 7 masked tokens leave DAPO's token count (19 -> 12)
    and each sequence's token mean; seq_mask's masked sequence 3 leaves GSPO's B (6 -> 5); all keeps them."""
    inp, _ = make_inputs()
    dapo = {c: policy_loss(inp, config("token_mask", kind="grpo", correction_count=c)) for c in ("all", "kept")}
    assert (int(dapo["all"].count), int(dapo["kept"].count)) == (19, 12)
    assert dapo["kept"].loss_sum.item() == dapo["all"].loss_sum.item()  # the sum over tokens is the same
    gspo = {c: policy_loss(inp, config("seq_mask", kind="gspo", correction_count=c)) for c in ("all", "kept")}
    assert (int(gspo["all"].count), int(gspo["kept"].count)) == (6, 5)
    # GSPO with equal weights under token_mask: each sequence's mean over its kept tokens, over the
    # sequences that keep any (sequence 3 keeps none; 5 is truncated but still counts)
    out = policy_loss(inp, config("token_mask", kind="gspo", seq_weighting="equal", correction_count="kept"))
    total, count = 0.0, 0
    for xs, a, t in zip(LOG_RHO, ADV.tolist(), TRUNC.tolist()):
        kept = [math.exp(x) for x in xs if LOW <= math.exp(x) <= HIGH]
        count += bool(kept)
        if kept and not t:
            total -= sum(kept) / len(kept) * a
    assert int(out.count) == count == 5
    assert out.loss_sum.item() / int(out.count) == pytest.approx(total / count, abs=1e-12)


@pytest.mark.parametrize("overrides, refused", [
    (["rollout.source=fleet", "model.hf_path=/m", "actor.max_prompt_tokens=48"], True),
    (["rollout.source=fleet", "model.hf_path=/m", "actor.max_prompt_tokens=48", "rollout.max_lag=1"], False),
    (["rollout.source=fleet", "model.hf_path=/m", "actor.max_prompt_tokens=48", "loss.correction_anchor=behaviour"],
     False),
    ([], False),  # tiny_local samples from the trained weights: nothing is stale
])
def test_the_unclipped_form_is_refused_with_an_unbounded_lag(overrides, refused):
    from megatron_apriel.config import to_run_config
    from tests.unit.config.test_config import compose_run

    args = ["loss.correction=token_tis", "loss.correction_anchor=current", *overrides]
    if overrides and overrides[-1].endswith("behaviour"):
        args.remove("loss.correction_anchor=current")
    if refused:
        with pytest.raises(ValueError, match=r"Set rollout.max_lag \(e.g. 1\), or loss.correction_anchor=behaviour"):
            to_run_config(compose_run("tiny_local", args))
    else:
        assert to_run_config(compose_run("tiny_local", args)).loss.correction == "token_tis"
