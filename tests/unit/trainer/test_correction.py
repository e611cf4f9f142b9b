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
CORRECTIONS = ["token_tis", "seq_tis", "token_mask", "seq_mask"]


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
        return min(g, C), [1.0] * len(rho)
    if correction == "token_mask":
        return 1.0, [r if LOW <= r <= HIGH else 0.0 for r in rho]
    return (1.0 if LOW <= g <= HIGH else 0.0), [min(r, C) for r in rho]  # seq_mask


def reference_loss(correction: str, kind: str, seq_weighting: str):
    """The decoupled loss with the proximal policy = the step's own weights (sg[pi]): the ratio is
    pi / sg[pi] (1 in value, so no clip binds) and each term carries the correction's weights.
    GSPO: -(1/B) sum_i v_i w_i mean_t w_t r_t A_i (v_i = n_i or 1); DAPO token_mean:
    -(1/T) sum_i sum_t w_i w_t r_t A_i. Truncated sequences carry no loss."""
    leaves = [torch.tensor(xs, dtype=torch.float64, requires_grad=True) for xs in LOG_RHO]
    total = torch.zeros((), dtype=torch.float64)
    tokens = sum(len(xs) for xs in LOG_RHO)
    for lp, xs, a, t in zip(leaves, LOG_RHO, ADV, TRUNC):
        if t:
            continue
        w_seq, w_tok = reference_weights(correction, xs)
        r = torch.exp(lp - lp.detach())
        terms = torch.tensor(w_tok, dtype=torch.float64) * r * a * w_seq
        if kind == "grpo":
            total = total - terms.sum() / tokens
        else:
            v = len(xs) if seq_weighting == "length" else 1.0
            total = total - v * terms.mean() / len(LOG_RHO)
    total.backward()
    return total.detach(), [torch.zeros(len(xs), dtype=torch.float64) if lp.grad is None else lp.grad
                            for lp, xs in zip(leaves, LOG_RHO)]


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("kind, weighting", [("gspo", "length"), ("gspo", "equal"), ("gspo_token", "length"),
                                             ("grpo", "length")])
def test_each_correction_matches_the_reference_in_loss_and_gradient(correction, kind, weighting):
    cfg = LossConfig(kind=kind, seq_weighting=weighting, correction=correction, correction_clip=C,
                     correction_low=LOW, correction_high=HIGH, eps_low=0.2, eps_high=0.2)
    inp, logp_N = make_inputs()
    out = policy_loss(inp, cfg)
    (out.loss_sum / out.count).backward()
    ref, ref_grads = reference_loss(correction, kind, weighting)
    torch.testing.assert_close(out.loss_sum.detach() / out.count, ref, atol=1e-12, rtol=1e-12)
    for got, want in zip(grads_by_sequence(inp, logp_N), ref_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert torch.all(logp_N.grad[~inp.mask_N] == 0)


# what each correction cuts, counted by hand from LOG_RHO (the truncated sequence 5 counts too: the
# figures describe the stream, overlong filtering aside): tokens above C (2.5, 3, 3, 3, 5), tokens
# outside [0.5, 2] (2.5, 0.1, 3, 3, 3, 0.4, 5), sequences whose geometric mean is above C (3 and 5's
# exp((0.2 - 0.1 + log 5) / 3) = 1.86: only 3) or outside [0.5, 2] (only 3)
HAND_CUT = {"token_tis": (5, 0), "seq_tis": (0, 1), "token_mask": (7, 0), "seq_mask": (2, 1), "none": (0, 0)}


@pytest.mark.parametrize("correction", [*CORRECTIONS, "none"])
def test_the_cut_shares_are_the_hand_counts(correction):
    inp, _ = make_inputs()
    out = policy_loss(inp, LossConfig(correction=correction, correction_clip=C, correction_low=LOW,
                                      correction_high=HIGH))
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
    cfg = LossConfig(kind="gspo", correction="seq_mask", correction_clip=C, correction_low=LOW,
                     correction_high=HIGH)
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


@pytest.mark.parametrize("correction", [*CORRECTIONS, "none"])
def test_a_token_vllm_gave_almost_no_probability_overflows_no_weight_or_figure(correction):
    """log rho = 1e4 (vLLM's log-prob -1e4): exp overflows, so each rho is exp of log rho clamped to
    [-20, 20]; the weights and KL figure stay finite and |log rho| reports the token as it is."""
    inp, _ = make_inputs()
    old = inp.old_logp_N.clone()
    old[2] = -1e4  # the first token of sequence 0 (fresh)
    inp = inp._replace(old_logp_N=old)
    out = policy_loss(inp, LossConfig(correction=correction, correction_clip=C, correction_low=LOW,
                                      correction_high=HIGH))
    figures = finalize_metrics(_totals(out.metrics))
    assert math.isfinite(figures["mismatch/all/kl_k3"]) and math.isfinite(figures["mismatch/stale/kl_k3"])
    assert figures["mismatch/fresh/kl_k3"] > 1e7  # (e^20 - 1 - 20) over the fresh tokens: huge, not inf
    assert figures["mismatch/fresh/abs_log_rho"] > 1e3  # unbounded: the figure says what vLLM gave
    assert figures["mismatch/stale/abs_log_rho"] == pytest.approx(
        sum(abs(x) for xs, lags in zip(LOG_RHO, LAGS) for x, lag in zip(xs, lags) if lag > 0)
        / sum(lag > 0 for lags in LAGS for lag in lags))
    assert torch.isfinite(out.loss_sum)
