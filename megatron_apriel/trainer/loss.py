"""Policy losses: GSPO (sequence and token forms) and token-level GRPO/DAPO. Pure functions.

Layout: every per-token tensor is flat, ``[N]`` = all token positions of a micro-batch (padded
rows flattened, or packed rows), with ``mask_N`` marking the completion tokens that carry a loss
and ``seq_N`` giving each such token's sequence index in ``[0, S)``. Per-sequence tensors are
``[S]``. This one layout serves padded and packed batches alike.

Each loss returns an un-normalised ``loss_sum`` and the ``count`` it must be divided by
(sequences or tokens of the whole optimizer step). The step sums both over micro-batches and
data-parallel ranks and divides once (Megatron's ``calculate_per_token_loss`` path), so the
result does not depend on how the batch was split.

GSPO as the Apriel authors run it (RECIPE.md 2.2), with n_i completion tokens and m_i = 0 for
filtered (truncated) sequences:
    log s_i = sum_t (logp_t - old_logp_t) / n_i
    loss    = -(1/B) sum_i w_i m_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
with w_i = n_i ("length", the authors' choice) or 1 ("equal"), B = sequences in the step.

Mismatch corrections (``loss.correction``, RECIPE.md section 10): with rho_t = pi_t / mu_t, the
trainer's probability of token t under the weights that start the step over vLLM's (log rho clamped
to +-20), and g_i = exp(mean_t log rho_t), a correction weighs each token (w_t) or sequence (w_i),
detached, or masks it. ``loss.correction_anchor`` says what the ratio is taken against:
- behaviour (the default): mu, as the recipe, so its clip keeps the trust region. That ratio carries
  rho in value already (rho_t per token for grpo, g_i for GSPO), so each weight is divided by it:
  where the clip does not bind the gradient is the one below, where it binds it is 0 (`on_behaviour`);
- current: the step's own weights, sg[pi]. The trainer makes one optimizer step per batch, so the
  proximal policy of the decoupled loss is sg[pi], its ratio is 1 in value (the clip never binds),
  and the loss is the policy gradient weighted by w, as the peers' bypass corrections.
``loss.correction_count=kept`` leaves what a mask dropped out of the counts the loss divides by.

Context parallelism: a rank holds part of each sequence's tokens. ``seq_total`` sums an ``[S]``
tensor over the ranks that share the sequences (the CP group); the per-sequence quantities (n_i,
log s_i) use it, with the gradient flowing through this rank's own tokens only. Every loss then
sums over tokens (GSPO in its token form, same value and gradient), so the ranks' ``loss_sum``
add up to the whole loss; per-sequence counts and metrics come from ``counts_sequences`` ranks only.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from megatron_apriel.trainer.config import LossConfig


class LossInputs(NamedTuple):
    logp_N: torch.Tensor  # float [N], current policy, differentiable
    old_logp_N: torch.Tensor  # float [N], behaviour policy (vLLM sampling log-probs)
    mask_N: torch.Tensor  # bool [N], completion tokens that carry a loss
    seq_N: torch.Tensor  # int64 [N], sequence index in [0, S) (ignored where mask_N is False)
    adv_S: torch.Tensor  # float [S], advantage of each sequence
    truncated_S: torch.Tensor  # bool [S], finished by the length limit
    entropy_N: torch.Tensor | None = None  # float [N], optional, for metrics only
    fresh_N: torch.Tensor | None = None  # bool [N], optional: loss tokens sampled by the weights being trained
    lag_N: torch.Tensor | None = None  # int [N], optional: versions between the token's weights and the trained ones
    stale_cache_N: torch.Tensor | None = None  # bool [N], optional: sampled over KV older than its own weights
    seq_total: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # [S] -> [S] summed over the CP group
    counts_sequences: bool = True  # this rank counts per-sequence terms (under CP: CP rank 0 only)


class LossOutput(NamedTuple):
    loss_sum: torch.Tensor  # scalar, differentiable; divide by the step's total ``count``
    count: torch.Tensor  # int scalar: sequences (gspo, grpo seq_mean) or tokens (grpo token_mean)
    metrics: dict  # name -> scalar tensor; *_min / *_max reduce by min / max, others by sum


def _per_seq_sum(values_N: torch.Tensor, inp: LossInputs, n_seq: int) -> torch.Tensor:
    out = values_N.new_zeros(n_seq)
    return out.index_add(0, inp.seq_N[inp.mask_N], values_N[inp.mask_N])


def _clipped_objective(ratio, adv, eps_low: float, eps_high: float):
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    objective = torch.minimum(ratio * adv, clipped * adv)
    is_clipped = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
    return objective, is_clipped


def _whole(local_S: torch.Tensor, inp: LossInputs) -> torch.Tensor:
    """The per-sequence sum over every rank holding the sequences; differentiable through this rank's part."""
    if inp.seq_total is None:
        return local_S
    detached = local_S.detach()
    return local_S + (inp.seq_total(detached.clone()) - detached)


LOG_RHO_BOUND = 20.0
"""Every rho the corrections and their figures use is exp of a log rho clamped to [-20, 20] (verl's
safety bound, rho in [2e-9, 5e8]): a token vLLM gave (almost) no probability cannot overflow a weight."""


class Correction(NamedTuple):
    log_rho_N: torch.Tensor  # float [N], log pi_t - log mu_t, detached, in +-LOG_RHO_BOUND (0 off mask_N)
    token_w_N: torch.Tensor | None  # float [N], the tokens' weights; None: all 1
    seq_w_S: torch.Tensor | None  # float [S], the sequences' weights; None: all 1
    cut_N: torch.Tensor  # bool [N], loss tokens it truncated or masked, every token of a sequence it did included
    cut_S: torch.Tensor  # bool [S], sequences it truncated or masked
    dropped_N: torch.Tensor | None = None  # bool [N], loss tokens a mask took out (token_mask, seq_mask)
    log_g_S: torch.Tensor | None = None  # float [S], mean_t log rho_t over the whole sequence (None: none)


def _token_level(cfg: LossConfig, rho_N: torch.Tensor, mask_N: torch.Tensor):
    """(weights, cut, dropped) ``[N]`` of token_tis, token_mask, and the token TIS under seq_mask."""
    if cfg.correction == "token_mask":
        inside_N = (rho_N >= cfg.correction_low) & (rho_N <= cfg.correction_high)
        return torch.where(inside_N, rho_N, 0.0), mask_N & ~inside_N, mask_N & ~inside_N
    return rho_N.clamp(max=cfg.correction_clip), mask_N & (rho_N > cfg.correction_clip), None


def _seq_level(cfg: LossConfig, log_sum_S: torch.Tensor, n_tok_S: torch.Tensor):
    """(weights, cut, dropped) ``[S]`` of seq_tis, seq_is and seq_mask, from sum_t log rho_t."""
    live_S = n_tok_S > 0
    if cfg.correction == "seq_is":  # the product: its log bounded as every log rho is
        prod_S = log_sum_S.clamp(-LOG_RHO_BOUND, LOG_RHO_BOUND).exp()
        return prod_S.clamp(max=cfg.correction_seq_clip), live_S & (prod_S > cfg.correction_seq_clip), None
    geo_S = (log_sum_S / n_tok_S.clamp(min=1)).exp()
    if cfg.correction == "seq_tis":
        return geo_S.clamp(max=cfg.correction_seq_high), live_S & (geo_S > cfg.correction_seq_high), None
    inside_S = (geo_S >= cfg.correction_seq_low) & (geo_S <= cfg.correction_seq_high)  # seq_mask
    return inside_S.to(geo_S.dtype), live_S & ~inside_S, live_S & ~inside_S


def correction_weights(inp: LossInputs, cfg: LossConfig, n_tok_S: torch.Tensor) -> Correction:
    """The weights of ``cfg.correction`` (module docstring), from the detached log-probs."""
    n_seq = inp.adv_S.shape[0]
    log_rho_N = torch.where(inp.mask_N, (inp.logp_N.detach() - inp.old_logp_N).clamp(-LOG_RHO_BOUND, LOG_RHO_BOUND),
                            0.0)
    if cfg.correction == "none":
        none_S = torch.zeros(n_seq, dtype=torch.bool, device=log_rho_N.device)
        return Correction(log_rho_N, None, None, torch.zeros_like(inp.mask_N), none_S)
    log_sum_S = _whole(_per_seq_sum(log_rho_N, inp, n_seq), inp)  # [S]
    log_g_S = log_sum_S / n_tok_S.clamp(min=1)
    if cfg.correction in ("token_tis", "token_mask"):
        token_w_N, cut_N, dropped_N = _token_level(cfg, log_rho_N.exp(), inp.mask_N)
        return Correction(log_rho_N, token_w_N, None, cut_N, torch.zeros_like(n_tok_S, dtype=torch.bool), dropped_N,
                          log_g_S)
    seq_w_S, cut_S, dropped_S = _seq_level(cfg, log_sum_S, n_tok_S)
    seq = inp.seq_N.clamp(0, n_seq - 1)
    token_w_N, cut_N = None, inp.mask_N & cut_S[seq]
    if cfg.correction == "seq_mask":  # token TIS on the sequences it keeps
        token_w_N, over_N, _ = _token_level(cfg, log_rho_N.exp(), inp.mask_N)
        cut_N = cut_N | over_N
    dropped_N = None if dropped_S is None else inp.mask_N & dropped_S[seq]
    return Correction(log_rho_N, token_w_N, seq_w_S, cut_N, cut_S, dropped_N, log_g_S)


def on_behaviour(corr: Correction, inp: LossInputs, cfg: LossConfig) -> Correction:
    """The weights to put on a ratio taken against mu (``correction_anchor=behaviour``). That ratio
    carries rho already in value (rho_t per token for grpo, g_i per sequence for GSPO), so each
    weight is divided by it: wherever the clip does not bind, the gradient is that of the weights
    on the ratio pi / sg[pi]; where it binds, it is 0. A mask stays a mask."""
    n_seq = inp.adv_S.shape[0]
    seq = inp.seq_N.clamp(0, n_seq - 1)
    if cfg.kind == "grpo":
        w_N = torch.exp(-corr.log_rho_N)
        w_N = w_N if corr.token_w_N is None else w_N * corr.token_w_N
        w_N = w_N if corr.seq_w_S is None else w_N * corr.seq_w_S[seq]
        return corr._replace(token_w_N=w_N, seq_w_S=None)
    inv_g_S = torch.exp(-corr.log_g_S)
    if corr.token_w_N is None:
        return corr._replace(seq_w_S=inv_g_S * corr.seq_w_S)
    return corr._replace(token_w_N=corr.token_w_N * inv_g_S[seq])


def _anchor(cfg: LossConfig) -> str:
    """What the policy ratio is taken against: mu (the recipe, no correction), or the correction's anchor."""
    return "mu" if cfg.correction == "none" else cfg.correction_anchor


def _anchored_log_ratio(inp: LossInputs, cfg: LossConfig, corr: Correction) -> torch.Tensor:
    """log of the policy ratio ``[N]``: against mu (the recipe), or, with a correction, against mu
    with the value of log rho bounded (behaviour) or against sg[pi] (current)."""
    if _anchor(cfg) == "mu":
        return inp.logp_N - inp.old_logp_N
    own_N = inp.logp_N - inp.logp_N.detach()
    return own_N + corr.log_rho_N if _anchor(cfg) == "behaviour" else own_N


def _mu_ratio_stats(inp: LossInputs, cfg: LossConfig, corr: Correction, keep_S: torch.Tensor) -> dict:
    """``train/ratio_*`` and ``train/clip_fraction`` against mu when the loss's own ratio is against
    sg[pi] (1 in value): what the recipe's clip would see."""
    n_seq = inp.adv_S.shape[0]
    seq = inp.seq_N.clamp(0, n_seq - 1)
    if cfg.kind == "grpo":
        ratio_N = corr.log_rho_N.exp()
        _, clipped_N = _clipped_objective(ratio_N, inp.adv_S[seq], cfg.eps_low, cfg.eps_high)
        live = inp.mask_N & (keep_S[seq] > 0)
        return {"ratio": ratio_N[live], "clipped": clipped_N[live]}
    ratio_S = corr.log_g_S.exp()
    _, clipped_S = _clipped_objective(ratio_S, inp.adv_S, cfg.eps_low, cfg.eps_high)
    counted = (keep_S > 0) & inp.counts_sequences
    return {"ratio": ratio_S[counted], "clipped": clipped_S[counted]}


def _normalisers(inp: LossInputs, cfg: LossConfig, corr: Correction, n_tok_S: torch.Tensor):
    """(tokens per sequence ``[S]`` the loss's means divide by, kept loss tokens ``[N]``, sequences
    whose every token a mask dropped ``[S]``): with ``correction_count=kept`` the dropped leave them."""
    if cfg.correction_count == "all" or corr.dropped_N is None:
        return n_tok_S, inp.mask_N, torch.zeros_like(n_tok_S, dtype=torch.bool)
    kept_N = inp.mask_N & ~corr.dropped_N
    n_kept_S = _whole(_per_seq_sum(kept_N.to(inp.logp_N.dtype), inp, inp.adv_S.shape[0]), inp)
    return n_kept_S, kept_N, (n_tok_S > 0) & (n_kept_S == 0)


def policy_loss(inp: LossInputs, cfg: LossConfig) -> LossOutput:
    """Dispatch on ``cfg.kind``; see the module docstring for the layout and normalisation."""
    n_seq = inp.adv_S.shape[0]
    n_tok_S = _whole(_per_seq_sum(torch.ones_like(inp.logp_N), inp, n_seq).detach(), inp)  # [S]
    keep_S = (n_tok_S > 0).float()
    if cfg.overlong_filtering:
        keep_S = keep_S * (~inp.truncated_S).float()
    corr = correction_weights(inp, cfg, n_tok_S)
    log_ratio_N = _anchored_log_ratio(inp, cfg, corr)
    weights = on_behaviour(corr, inp, cfg) if _anchor(cfg) == "behaviour" else corr
    norm = _normalisers(inp, cfg, corr, n_tok_S)
    if cfg.kind == "grpo":
        loss_sum, count, ratio_stats = _grpo(inp, cfg, log_ratio_N, keep_S, n_tok_S, weights, norm)
    else:
        loss_sum, count, ratio_stats = _gspo(inp, cfg, log_ratio_N, keep_S, n_tok_S, weights, norm)
    if _anchor(cfg) == "current":
        ratio_stats = _mu_ratio_stats(inp, cfg, corr, keep_S)
    metrics = _metrics(inp, inp.logp_N - inp.old_logp_N, keep_S, n_tok_S, ratio_stats)
    metrics.update(_mismatch_metrics(inp, corr, n_tok_S))
    return LossOutput(loss_sum, count, metrics)


def _seq_count(inp: LossInputs, dropped_S: torch.Tensor, device) -> torch.Tensor:
    """The sequences the step divides by, less those a mask dropped whole (once over the CP group)."""
    if not inp.counts_sequences:
        return torch.zeros((), dtype=torch.int, device=device)
    return (inp.adv_S.shape[0] - dropped_S.sum()).to(device=device, dtype=torch.int)


def _gspo(inp, cfg, log_ratio_N, keep_S, n_tok_S, corr: Correction, norm):
    n_seq = inp.adv_S.shape[0]
    n_norm_S, _, dropped_S = norm
    log_s_S = _whole(_per_seq_sum(log_ratio_N, inp, n_seq), inp) / n_tok_S.clamp(min=1)
    weight_S = n_norm_S if cfg.seq_weighting == "length" else torch.ones_like(n_tok_S)
    if corr.seq_w_S is not None:
        weight_S = weight_S * corr.seq_w_S
    if cfg.kind == "gspo" and inp.seq_total is None and corr.token_w_N is None:
        s_S = log_s_S.exp()
        obj_S, clipped_S = _clipped_objective(s_S, inp.adv_S, cfg.eps_low, cfg.eps_high)
    else:  # gspo_token: s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)], averaged over the sequence's tokens
        log_s_N = inp.logp_N - inp.logp_N.detach() + log_s_S.detach()[inp.seq_N.clamp(0, n_seq - 1)]
        obj_N, _ = _clipped_objective(log_s_N.exp(), inp.adv_S[inp.seq_N.clamp(0, n_seq - 1)], cfg.eps_low,
                                      cfg.eps_high)
        if corr.token_w_N is not None:
            obj_N = obj_N * corr.token_w_N
        obj_S = _per_seq_sum(obj_N, inp, n_seq) / n_norm_S.clamp(min=1)
        s_S = log_s_S.detach().exp()
        _, clipped_S = _clipped_objective(s_S, inp.adv_S, cfg.eps_low, cfg.eps_high)
    loss_sum = -(weight_S * keep_S * obj_S).sum()
    count = _seq_count(inp, dropped_S, loss_sum.device)
    counted = (keep_S > 0) & inp.counts_sequences
    stats = {"ratio": s_S.detach()[counted], "clipped": clipped_S[counted]}
    return loss_sum, count, stats


def _grpo(inp, cfg, log_ratio_N, keep_S, n_tok_S, corr: Correction, norm):
    n_seq = inp.adv_S.shape[0]
    n_norm_S, kept_N, dropped_S = norm
    seq = inp.seq_N.clamp(0, n_seq - 1)
    ratio_N = log_ratio_N.exp()
    obj_N, clipped_N = _clipped_objective(ratio_N, inp.adv_S[seq], cfg.eps_low, cfg.eps_high)
    obj_N = obj_N * keep_S[seq]
    if corr.token_w_N is not None:
        obj_N = obj_N * corr.token_w_N
    if corr.seq_w_S is not None:
        obj_N = obj_N * corr.seq_w_S[seq]
    if cfg.aggregation == "token_mean":
        loss_sum = -obj_N[inp.mask_N].sum()
        count = kept_N.sum().to(torch.int)  # this rank's tokens: under CP the ranks' counts add up
    else:
        loss_sum = -(_per_seq_sum(obj_N, inp, n_seq) / n_norm_S.clamp(min=1)).sum()
        count = _seq_count(inp, dropped_S, loss_sum.device)
    live = inp.mask_N & (keep_S[seq] > 0)
    stats = {"ratio": ratio_N.detach()[live], "clipped": clipped_N[live]}
    return loss_sum, count, stats


METRIC_REDUCTIONS = {"ratio_min": "min", "ratio_max": "max", "drift_abs_max": "max"}
"""How the loss's raw metrics combine over micro-batches and ranks: these as named, the rest summed."""


def _metrics(inp, log_ratio_N, keep_S, n_tok_S, stats) -> dict:
    ratio, zero = stats["ratio"], inp.logp_N.new_zeros(())
    tok = inp.mask_N
    once = 1.0 if inp.counts_sequences else 0.0  # per-sequence counts, once over the CP group
    m = {
        "seqs": torch.tensor(float(inp.adv_S.shape[0]) * once),
        "tokens": inp.mask_N.sum().float(),
        "seqs_filtered": (keep_S == 0).sum().float() * once,
        "ratio_items": torch.tensor(float(ratio.numel())),
        "ratio_sum": ratio.sum() if ratio.numel() else zero,
        "ratio_min": ratio.min() if ratio.numel() else zero + float("inf"),
        "ratio_max": ratio.max() if ratio.numel() else zero - float("inf"),
        "clipped": stats["clipped"].sum().float(),
        # |log pi_theta - log pi_behaviour| per token: train/inference drift plus policy change
        "abs_log_ratio_sum": log_ratio_N.detach()[tok].abs().sum(),
    }
    if inp.entropy_N is not None:
        m["entropy_sum"] = inp.entropy_N.detach()[tok].sum()
    if inp.fresh_N is not None:
        # on tokens the trained weights sampled themselves, |log pi_train - log pi_vllm| is pure
        # train/inference drift (no policy change in between)
        drift = log_ratio_N.detach()[tok & inp.fresh_N].abs()
        m["drift_tokens"] = torch.tensor(float(drift.numel()))
        m["drift_abs_sum"] = drift.sum() if drift.numel() else zero
        m["drift_abs_max"] = drift.max() if drift.numel() else zero
    return {k: v.detach().float().to(inp.logp_N.device) for k, v in m.items()}


LAG_BUCKETS = 4
"""Mismatch metrics are kept per token lag 0 (fresh), 1, 2 and ``LAG_BUCKETS - 1`` or more."""
CACHE = "cache"
"""The bucket of lag-0 tokens sampled over a stale KV cache (``fleet.kv_on_update=keep``)."""


def _mismatch_metrics(inp: LossInputs, corr: Correction, n_tok_S: torch.Tensor) -> dict:
    """Sums per lag bucket over the loss tokens: count, |log rho| (unbounded: a token vLLM gave no
    probability shows as inf), the k3 estimate of KL(mu || pi) ((rho - 1) - log rho, >= 0, from the
    bounded log rho) and the tokens the correction cut; and the sequences it cut."""
    tok = inp.mask_N
    log_rho = torch.where(tok, inp.logp_N.detach() - inp.old_logp_N, 0.0)
    bounded = corr.log_rho_N.detach().double()
    k3 = torch.expm1(bounded) - bounded  # fp64: at fp32 round-off drift, exp(x) - 1 - x cancels
    once = 1.0 if inp.counts_sequences else 0.0
    m = {"mm_seqs": (n_tok_S > 0).sum().float() * once, "mm_seqs_cut": corr.cut_S.sum().float() * once}
    lag = inp.lag_N.clamp(0, LAG_BUCKETS - 1) if inp.lag_N is not None else torch.zeros_like(inp.seq_N)
    buckets: list = list(range(LAG_BUCKETS)) if inp.lag_N is not None else ["all"]
    over_stale_cache = tok & (lag == 0) & inp.stale_cache_N if inp.stale_cache_N is not None else None
    if inp.lag_N is not None and over_stale_cache is not None:
        buckets.append(CACHE)  # lag 0 over a stale KV cache: apart from bucket 0, the truly fresh tokens
    for k in buckets:  # masked sums, not boolean indexing: no device-to-host sync in the schedule
        if k == "all":
            where = tok
        elif k == CACHE:
            where = over_stale_cache
        else:
            where = tok & (lag == k) if over_stale_cache is None else tok & (lag == k) & ~over_stale_cache
        m[f"mm_{k}_tokens"] = where.sum().float()
        m[f"mm_{k}_abs_log_rho_sum"] = torch.where(where, log_rho.abs(), 0.0).sum()  # an inf stays in its bucket
        m[f"mm_{k}_k3_sum"] = (k3 * where).sum()
        m[f"mm_{k}_cut"] = (corr.cut_N & where).sum().float()
    return {k: v.detach().float().to(inp.logp_N.device) for k, v in m.items()}


def _mismatch_figures(totals: dict, name: str, buckets: list) -> dict:
    tokens = sum(float(totals[f"mm_{k}_tokens"]) for k in buckets)
    if tokens == 0:
        return {}
    total = {q: sum(float(totals[f"mm_{k}_{q}"]) for k in buckets) for q in ("abs_log_rho_sum", "k3_sum", "cut")}
    return {f"mismatch/{name}/tokens": tokens, f"mismatch/{name}/abs_log_rho": total["abs_log_rho_sum"] / tokens,
            f"mismatch/{name}/kl_k3": total["k3_sum"] / tokens, f"mismatch/{name}/cut_share": total["cut"] / tokens}


def finalize_mismatch(totals: dict) -> dict:
    """The logged mismatch figures (keys under ``mismatch/``): over all loss tokens; if the tokens'
    lags are known, on fresh tokens (pure train/inference drift), on stale ones (drift plus policy
    change) and per lag; under ``fleet.kv_on_update=keep``, apart, on the tokens sampled by the
    trained weights over a KV cache older weights computed (``fresh_stale_cache``: drift plus the
    stale cache's share); and the share of sequences the correction cut."""
    if "mm_seqs" not in totals:
        return {}
    lagged = "mm_0_tokens" in totals
    buckets = list(range(LAG_BUCKETS)) if lagged else ["all"]
    cached = [CACHE] if f"mm_{CACHE}_tokens" in totals else []
    out = _mismatch_figures(totals, "all", buckets + cached)
    out["mismatch/seqs_cut_share"] = float(totals["mm_seqs_cut"]) / max(float(totals["mm_seqs"]), 1.0)
    if lagged:
        out.update(_mismatch_figures(totals, "fresh", [0]))
        if cached:
            out.update(_mismatch_figures(totals, "fresh_stale_cache", cached))
        out.update(_mismatch_figures(totals, "stale", buckets[1:]))
        for k in buckets[1:]:
            label = f"lag{k}" if k < LAG_BUCKETS - 1 else f"lag{k}+"
            out.update(_mismatch_figures(totals, label, [k]))
    return out


def finalize_metrics(totals: dict) -> dict:
    """Turn reduced sums/min/max into the logged means (keys under ``train/``)."""
    items = max(float(totals["ratio_items"]), 1.0)
    tokens = max(float(totals["tokens"]), 1.0)
    out = {
        "train/ratio_mean": float(totals["ratio_sum"]) / items,
        "train/ratio_min": float(totals["ratio_min"]),
        "train/ratio_max": float(totals["ratio_max"]),
        "train/clip_fraction": float(totals["clipped"]) / items,
        "train/abs_log_ratio": float(totals["abs_log_ratio_sum"]) / tokens,
        "train/seqs": float(totals["seqs"]),
        "train/tokens": float(totals["tokens"]),
        "train/seqs_filtered": float(totals["seqs_filtered"]),
    }
    if "entropy_sum" in totals:
        out["train/entropy"] = float(totals["entropy_sum"]) / tokens
    if "drift_tokens" in totals:
        out["train/drift_tokens_share"] = float(totals["drift_tokens"]) / tokens
        if totals["drift_tokens"] > 0:
            out["train/drift_abs_mean"] = float(totals["drift_abs_sum"]) / float(totals["drift_tokens"])
            out["train/drift_abs_max"] = float(totals["drift_abs_max"])
    return out | finalize_mismatch(totals)


def gspo_loss(inp: LossInputs, cfg: LossConfig | None = None) -> LossOutput:
    """GSPO with the authors' defaults (public name, see ARCHITECTURE.md)."""
    cfg = cfg or LossConfig()
    if cfg.kind == "grpo":
        raise ValueError("gspo_loss got loss.kind=grpo; call policy_loss for GRPO/DAPO.")
    return policy_loss(inp, cfg)
