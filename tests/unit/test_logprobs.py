"""Vocab-parallel log-probs against torch.log_softmax on the full vocabulary."""

import torch

from megatron_apriel.trainer.logprobs import vocab_parallel_logprobs


def test_matches_log_softmax_with_temperature_and_padding():
    g = torch.Generator().manual_seed(0)
    vocab, padded = 11, 16
    logits = torch.randn(2, 5, padded, generator=g, dtype=torch.float64).float().requires_grad_(True)
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    weights = torch.randn(2, 5, generator=g)

    logp, entropy = vocab_parallel_logprobs(logits, targets, vocab_size=vocab, temperature=0.7)
    (logp * weights).sum().backward()

    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_logsm = torch.log_softmax(ref_logits[..., :vocab] / 0.7, dim=-1)
    ref = ref_logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (ref * weights).sum().backward()
    ref_entropy = -(ref_logsm.exp() * ref_logsm).sum(-1)

    torch.testing.assert_close(logp, ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=1e-6)
    assert torch.all(logits.grad[..., vocab:] == 0)  # padded columns get no gradient


def test_two_slices_without_a_group_are_not_the_full_answer():
    """Sanity of the slicing arithmetic: rank 1 of 2 without reduction sees only its targets."""
    logits = torch.randn(1, 3, 8)
    targets = torch.tensor([[1, 5, 7]])
    lp1, _ = vocab_parallel_logprobs(logits[..., 4:], targets, vocab_size=8, tp_rank=1)
    full, _ = vocab_parallel_logprobs(logits, targets, vocab_size=8)
    # without the TP all-reduce the normaliser is partial, so values must differ
    assert not torch.allclose(lp1, full)
