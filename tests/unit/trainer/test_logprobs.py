"""Vocab-parallel log-probs against torch.log_softmax on the full vocabulary (one rank, and two over gloo)."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def _tp_rank(rank, world, init_file, logits, targets, weights, vocab, temperature, out_dir):
    """One tensor-parallel rank: its contiguous slice of the padded vocabulary, reduced over gloo."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        width = logits.shape[-1] // world
        local = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
        logp, entropy = vocab_parallel_logprobs(local, targets, vocab_size=vocab, temperature=temperature,
                                                tp_group=dist.group.WORLD, tp_rank=rank)
        (logp * weights).sum().backward()
        torch.save({"logp": logp.detach(), "entropy": entropy, "grad": local.grad}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_tensor_parallel_slices_reduce_to_the_full_vocabulary(tmp_path):
    """Two gloo ranks, each holding half of the padded vocabulary (rank 1: 3 real columns, 5 padded),
    give every target, in either half, the log-prob, entropy and gradient of the full log_softmax."""
    g = torch.Generator().manual_seed(1)
    vocab, padded, temperature = 11, 16, 0.7
    logits = torch.randn(2, 6, padded, generator=g)
    targets = torch.tensor([[0, 7, 8, 10, 3, 9], [10, 1, 8, 5, 7, 2]])  # both halves, their edges included
    weights = torch.randn(2, 6, generator=g)
    mp.spawn(_tp_rank, args=(2, str(tmp_path / "rendezvous"), logits, targets, weights, vocab, temperature,
                             str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    ref_logits = logits.clone().requires_grad_(True)
    ref_logsm = torch.log_softmax(ref_logits[..., :vocab] / temperature, dim=-1)
    ref = ref_logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (ref * weights).sum().backward()
    ref_entropy = -(ref_logsm.exp() * ref_logsm).sum(-1)
    for r in ranks:
        torch.testing.assert_close(r["logp"], ref.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(r["entropy"], ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks], dim=-1), ref_logits.grad, atol=1e-6, rtol=1e-6)
