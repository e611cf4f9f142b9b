"""Vocab-parallel log-probs, from full logits and chunked from hidden states, against
torch.log_softmax on the full vocabulary (one rank, and two over gloo)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_apriel.trainer.logprobs import chunked_head_logprobs, vocab_parallel_logprobs


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


def _reference(hidden, weight, targets, vocab, temperature, grad_weights):
    """log_softmax over the true vocabulary of hidden @ weight.T / temperature, in float64."""
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    logsm = torch.log_softmax((h @ w.t())[:, :vocab] / temperature, dim=-1)
    logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (logp * grad_weights.double()).sum().backward()
    return logp.detach(), -(logsm.exp() * logsm).sum(-1).detach(), h.grad, w.grad


def _inputs(seed, n=23, h=6, padded=16, vocab=11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(padded, h, generator=g)
    targets = torch.randint(0, vocab, (n,), generator=g)
    return hidden, weight, targets, torch.randn(n, generator=g)


@pytest.mark.parametrize("chunk", [1, 4, 23, 40])
def test_chunked_head_logprobs_match_log_softmax_of_the_full_logits(chunk):
    hidden, weight, targets, grad_w = _inputs(2)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp, entropy = chunked_head_logprobs(h, w, targets, vocab_size=11, chunk_tokens=chunk, temperature=0.7)
    (logp * grad_w).sum().backward()
    ref_logp, ref_entropy, ref_gh, ref_gw = _reference(hidden, weight, targets, 11, 0.7, grad_w)
    torch.testing.assert_close(logp.double(), ref_logp, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.grad.double(), ref_gh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), ref_gw, atol=1e-5, rtol=1e-5)
    assert torch.all(w.grad[11:] == 0)  # padded rows of the vocabulary get no gradient


def test_chunked_head_computes_in_the_head_dtype_as_the_output_layer_does():
    """bf16 weights: the matmul in bf16 (what a bf16 output layer's logits are), or in fp32 for an
    fp32 head; either way the result equals the full-logits path on logits made the same way."""
    hidden, weight, targets, _ = _inputs(3)
    h, w = hidden.bfloat16(), weight.bfloat16()
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.nn.functional.linear(h.to(dtype), w.to(dtype))
        full, _ = vocab_parallel_logprobs(logits, targets, vocab_size=11)
        chunked, _ = chunked_head_logprobs(h, w, targets, vocab_size=11, chunk_tokens=5, compute_dtype=dtype)
        torch.testing.assert_close(chunked, full, atol=1e-6, rtol=0)
    bf16, _ = chunked_head_logprobs(h, w, targets, vocab_size=11, chunk_tokens=5)
    fp32, _ = chunked_head_logprobs(h, w, targets, vocab_size=11, chunk_tokens=5, compute_dtype=torch.float32)
    assert (bf16 - fp32).abs().max() > 1e-4  # the dtype is honoured, not ignored


class _LargestLogits(TorchDispatchMode):
    """The most elements of any tensor with the vocabulary as its last dimension that an op made."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_head_never_holds_more_than_one_chunk_of_logits_forward_or_backward():
    hidden, weight, targets, grad_w = _inputs(4, n=200, h=5, padded=16)
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    with _LargestLogits(16) as seen:
        logp, _ = chunked_head_logprobs(h, w, targets, vocab_size=11, chunk_tokens=8)
        (logp * grad_w).sum().backward()
    assert 0 < seen.largest <= 8 * 16
    with _LargestLogits(16) as full:  # the same probe sees the full path's [200, 16]
        vocab_parallel_logprobs(torch.nn.functional.linear(h, w), targets, vocab_size=11)
    assert full.largest == 200 * 16


def _chunked_tp_rank(rank, world, init_file, hidden, weight, targets, grad_w, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rows = weight.shape[0] // world
        w = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
        h = hidden.clone().requires_grad_(True)
        logp, entropy = chunked_head_logprobs(h, w, targets, vocab_size=11, chunk_tokens=4, temperature=0.7,
                                              tp_group=dist.group.WORLD, tp_rank=rank)
        (logp * grad_w).sum().backward()
        torch.save({"logp": logp.detach(), "entropy": entropy, "gh": h.grad, "gw": w.grad}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_chunked_head_over_two_tensor_parallel_slices_of_the_output_weight(tmp_path):
    """Each gloo rank holds half the padded output weight; the log-probs and entropies are the full
    vocabulary's on both, the weight gradients are the slices of the full one, and the hidden-state
    gradients sum (the all-reduce the model's copy-to-TP region does) to the full one."""
    hidden, weight, targets, grad_w = _inputs(5)
    targets[:4] = torch.tensor([0, 7, 8, 10])  # both halves, their edges included
    mp.spawn(_chunked_tp_rank, args=(2, str(tmp_path / "rendezvous"), hidden, weight, targets, grad_w,
                                     str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref_logp, ref_entropy, ref_gh, ref_gw = _reference(hidden, weight, targets, 11, 0.7, grad_w)
    for r in ranks:
        torch.testing.assert_close(r["logp"].double(), ref_logp, atol=2e-6, rtol=1e-6)
        torch.testing.assert_close(r["entropy"].double(), ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r["gw"] for r in ranks]).double(), ref_gw, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((ranks[0]["gh"] + ranks[1]["gh"]).double(), ref_gh, atol=1e-5, rtol=1e-5)
