"""TP=1 (DP=2), TP=2 (also with sequence parallelism) and PP=2, padded and packed: same log-probs,
loss and updated weights; the chunked log-probs (5 tokens of logits at a time, chunks straddling
sequences and packed rows) against the full logits, tied and untied; context parallelism (CP 2)
against no CP, GSPO and DAPO; and
TP=1 against an independent single-process computation (transformers), so that a bug every
layout shares cannot pass. Half the samples are multi-turn trajectories: environment tokens between
the model's turns go through every forward pass and carry no loss, which the transformers reference
leaves out of its loss.

Runs tests/dist/layouts.py under ``torchrun --nproc_per_node 2`` (gloo, real Megatron-Core).
"""


import pytest
import torch

from megatron_apriel.convert.mapping import canonical_to_hf
from tests.dist.layouts import ARCH, GSPO, SEQ_MASK, samples
from tests.unit.conftest import run_dist
from tests.unit.trainer.test_loss import reference_gspo

pytestmark = pytest.mark.integration  # its tests start processes of their own

ATOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts") / "results.pt"
    run_dist("layouts.py", str(out))
    return torch.load(out, weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


METRICS = ("train/loss", "train/ratio_mean", "train/ratio_min", "train/ratio_max", "train/clip_fraction",
           "train/entropy", "train/grad_norm", "train/tokens", "train/seqs_filtered")


def assert_same_step(a: dict, b: dict) -> None:
    """Two runs of the same step: every sample's log-probs, the step's metrics and the updated weights."""
    assert len(a["logp"]) == 8
    assert _max_diff(a["logp"], b["logp"]) < ATOL
    for key in METRICS:
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], abs=ATOL), key
    assert _max_diff(a["weights"], b["weights"]) < ATOL


@pytest.mark.parametrize("name", ["gspo/tp2", "gspo/pp2", "gspo/tp1_dp2_packed", "gspo/tp2_packed", "gspo/pp2_packed",
                                  "gspo/tp2_sp", "gspo/tp2_sp_packed"])
def test_logprobs_loss_and_step_agree_across_layouts(results, name):
    assert_same_step(results[name], results["gspo/tp1_dp2"])


@pytest.mark.parametrize("chunked, full", [("gspo/tp1_dp2", "full/tp1_dp2"), ("gspo/tp2_packed", "full/tp2_packed"),
                                           ("gspo/tp2_sp", "full/tp2_sp"), ("gspo/pp2_packed", "full/pp2_packed"),
                                           ("tied/tp1_dp2_packed", "tied_full/tp1_dp2_packed"),
                                           ("tied/tp2", "tied_full/tp2"), ("tied/pp2", "tied_full/pp2")])
def test_chunked_logprobs_from_hidden_states_equal_the_full_logits_path(results, chunked, full):
    assert_same_step(results[chunked], results[full])


@pytest.mark.parametrize("cp, base", [("cp/cp2_packed", "gspo/tp1_dp2_packed"), ("cp/cp2_packed_full", "cp/cp2_packed"),
                                      ("cp/cp2_packed_dapo", "dapo/tp1_dp2")])
def test_context_parallel_steps_equal_the_unsplit_ones(results, cp, base):
    """Each packed sequence in 4 chunks over 2 CP ranks (rank 0 holds chunks 0 and 3): the same
    log-probs (reassembled by position), loss, metrics (tokens and sequences counted once, not per
    CP rank), gradient norm and updated weights as without CP."""
    assert_same_step(results[cp], results[base])


def test_tied_layouts_agree(results):
    base = results["tied/tp1_dp2_packed"]
    assert "output_layer.weight" not in base["weights"]
    for name in ("tied/tp2", "tied/pp2"):
        assert _max_diff(base["logp"], results[name]["logp"]) < ATOL
        assert _max_diff(base["weights"], results[name]["weights"]) < ATOL


def test_the_step_moves_the_weights(results):
    moved = _max_diff(results["initial"], results["gspo/tp1_dp2"]["weights"])
    assert moved > 1e-3  # so that the agreement above is not trivially about unchanged weights


def test_dapo_token_mean_agrees_between_dp_and_packed_pp(results):
    a, b = results["dapo/tp1_dp2"], results["dapo/pp2_packed"]
    assert a["metrics"]["train/loss"] == pytest.approx(b["metrics"]["train/loss"], abs=ATOL)
    assert _max_diff(a["weights"], b["weights"]) < ATOL
    assert a["metrics"]["train/loss"] != pytest.approx(results["gspo/tp1_dp2"]["metrics"]["train/loss"], abs=1e-3)


def test_some_sequences_hit_the_clip_and_one_is_filtered(results):
    m = results["gspo/tp1_dp2"]["metrics"]
    assert 0 < m["train/clip_fraction"] < 1
    assert m["train/seqs_filtered"] == 1


MISMATCH = ("mismatch/fresh/abs_log_rho", "mismatch/stale/kl_k3", "mismatch/lag2/abs_log_rho",
            "mismatch/all/cut_share", "mismatch/seqs_cut_share")


@pytest.mark.parametrize("name, base", [("seqmask/tp2", "seqmask/tp1_dp2"), ("seqmask/pp2", "seqmask/tp1_dp2"),
                                        ("seqmask/tp1_dp2_packed", "seqmask/tp1_dp2"),
                                        ("seqmask/cp2_packed", "seqmask/tp1_dp2"),
                                        ("tokmask/pp2_packed", "tokmask/tp1_dp2")])
def test_corrections_and_mismatch_figures_agree_across_layouts(results, name, base):
    """loss.correction=seq_mask (sequence weights summed over CP ranks, then token TIS, on the behaviour
    anchor) and token_mask (on the current anchor): the same step and the same mismatch figures at
    every layout."""
    assert_same_step(results[name], results[base])
    for key in MISMATCH:
        assert results[name]["metrics"][key] == pytest.approx(results[base]["metrics"][key], abs=ATOL), key


@pytest.mark.parametrize("name", ["gspo/tp1_dp2", "gspo/tp2", "gspo/pp2_packed", "cp/cp2_packed", "seqmask/cp2_packed"])
def test_each_servers_fresh_drift_is_the_mean_over_the_fresh_tokens_it_sampled(results, name):
    """Per server (three, the samples spread over DP ranks, micro-batches and CP halves): mean
    |log pi - log mu| over its lag-0 tokens, from the step's own log-probs."""
    run, want = results[name], {}
    for i, s in enumerate(samples()):
        fresh = torch.as_tensor(s.lags) == 0
        drift = (run["logp"][i].double() - torch.as_tensor(s.behaviour_logprobs).double()).abs()[fresh]
        total = want.setdefault(s.server.split("://")[1], [0.0, 0])
        total[0], total[1] = total[0] + drift.sum().item(), total[1] + int(fresh.sum())
    assert len(want) == 3
    for server, (drift, tokens) in want.items():
        assert run["metrics"][f"mismatch/server/{server}/fresh_tokens"] == tokens
        assert run["metrics"][f"mismatch/server/{server}/fresh_abs_log_rho"] == pytest.approx(drift / tokens, abs=ATOL)


def test_the_seq_mask_step_is_the_reference_loss_of_its_log_probs(results):
    """From the step's own log-probs (taken before it) and the samples' behaviour log-probs, the
    corrected loss by the formulas, on the behaviour anchor (the default): -(1/B) sum_i n_i w_i
    mean_t (min(rho_t, C) / g_i) min(g_i A_i, clip(g_i) A_i), the GSPO ratio against mu being the
    geometric mean g_i of rho, and w_i = 1 if g_i is in [seq_low, seq_high] else 0."""
    run, cfg = results["seqmask/tp1_dp2"], SEQ_MASK
    total, cut = 0.0, 0
    for i, s in enumerate(samples()):
        log_rho = run["logp"][i].double() - torch.as_tensor(s.behaviour_logprobs).double()
        geo = log_rho.mean().exp().item()
        inside = cfg.correction_seq_low <= geo <= cfg.correction_seq_high
        cut += not inside
        if s.truncated or not inside:
            continue
        clipped = min(geo * s.advantage, min(max(geo, 1 - cfg.eps_low), 1 + cfg.eps_high) * s.advantage)
        total -= len(log_rho) * (log_rho.exp().clamp(max=cfg.correction_clip) / geo).mean().item() * clipped
    assert run["metrics"]["train/loss"] == pytest.approx(total / len(samples()), abs=ATOL)
    assert run["metrics"]["mismatch/seqs_cut_share"] == pytest.approx(cut / len(samples()))
    assert 0 < cut < len(samples())  # the case masks some sequences and keeps others
    assert 0 < run["metrics"]["mismatch/all/cut_share"] < 1  # and truncates some tokens of those it keeps
    assert 0 < results["tokmask/tp1_dp2"]["metrics"]["mismatch/all/cut_share"] < 1


def _transformers_model(canonical: dict):
    """The same weights in transformers' own Qwen2 (fp32, eager attention), configured from ARCH by hand."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=ARCH.vocab_size, hidden_size=ARCH.hidden_size,
                         intermediate_size=ARCH.ffn_hidden_size, num_hidden_layers=ARCH.num_layers,
                         num_attention_heads=ARCH.num_heads, num_key_value_heads=ARCH.num_kv_heads,
                         head_dim=ARCH.head_dim, rms_norm_eps=ARCH.norm_eps, rope_theta=ARCH.rope_theta,
                         max_position_embeddings=ARCH.max_position_embeddings, tie_word_embeddings=False,
                         use_sliding_window=False)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.load_state_dict(canonical_to_hf(canonical, ARCH), strict=True)
    return model


def test_tp1_matches_a_transformers_forward_of_the_same_weights(results):
    """The absolute reference the layouts above are tied to: token log-probs at the loss temperature
    (logits / T, then log_softmax), their entropy, the GSPO loss of test_loss.py's hand reference
    and the norm of its gradient, all from transformers on the initial weights (the step's forward
    runs before its update). A bug common to every layout, e.g. the temperature ignored, fails here."""
    model = _transformers_model(results["initial"])
    tp1 = results["gspo/tp1_dp2"]
    seqs, entropy_sum, tokens = [], 0.0, 0
    batch = samples()
    assert sum(s.mask is not None for s in batch) == 4  # multi-turn: the environment's tokens are context only
    for i, s in enumerate(batch):
        model_tokens = torch.from_numpy(s.completion_mask())
        logits = model(torch.tensor([s.tokens])).logits[0, s.prompt_len - 1 : len(s.tokens) - 1][model_tokens]
        log_softmax = torch.log_softmax(logits / GSPO.temperature, dim=-1)
        labels = torch.tensor(s.tokens[s.prompt_len:])[model_tokens]
        logp = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(tp1["logp"][i], logp.detach(), atol=ATOL, rtol=0)
        entropy_sum += float(-(log_softmax.exp() * log_softmax).sum().detach())
        tokens += len(logp)
        seqs.append((logp, torch.tensor(s.behaviour_logprobs)))
    adv = torch.tensor([s.advantage for s in batch])
    truncated = torch.tensor([s.truncated for s in batch])
    loss = reference_gspo(seqs, adv, truncated, GSPO.seq_weighting, GSPO.overlong_filtering,
                          eps_low=GSPO.eps_low, eps_high=GSPO.eps_high)
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
    m = tp1["metrics"]
    assert m["train/loss"] == pytest.approx(loss.item(), abs=ATOL)
    assert m["train/entropy"] == pytest.approx(entropy_sum / tokens, abs=ATOL)
    assert m["train/tokens"] == tokens
    assert m["train/grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)
