"""Padded and packed micro-batches put every label and behaviour log-prob where it belongs."""

import pytest
import torch

from megatron_apriel.model.attention import block_causal_mask
from megatron_apriel.parallel.context import cp_positions
from megatron_apriel.trainer.batch import (
    TrainSample,
    cp_shard,
    pack_bins,
    packed_microbatches,
    padded_microbatches,
    split_for_data_parallel,
)


def samples():
    return [TrainSample(list(range(100 * i, 100 * i + n)), p, [-(i + 0.1 * k) for k in range(n - p)], advantage=i)
            for i, (n, p) in enumerate([(7, 3), (5, 1), (9, 4), (4, 2), (6, 6)])]


def _scored(mb, j):
    """(label, old_logp) pairs of sequence j in a micro-batch, in order."""
    sel = mb.loss_mask & (mb.seq == j)
    return list(zip(mb.labels[sel].tolist(), mb.old_logp[sel].tolist()))


@pytest.mark.parametrize("packed", [False, True])
def test_every_completion_token_is_scored_once_with_its_behaviour_logprob(packed):
    data = samples()
    mbs = packed_microbatches(data, list(range(5)), 16) if packed else padded_microbatches(data, list(range(5)), 2, 16)
    seen = {}
    for mb in mbs:
        for j, sid in enumerate(mb.sample_ids):
            seen[sid] = _scored(mb, j)
            assert mb.advantages[j] == data[sid].advantage
    for sid, s in enumerate(data):
        expected = list(zip(s.tokens[s.prompt_len:], s.behaviour_logprobs))
        assert [t for t, _ in seen[sid]] == [t for t, _ in expected]
        assert [lp for _, lp in seen[sid]] == pytest.approx([lp for _, lp in expected])


def test_packed_rows_restart_positions_and_describe_segments():
    mbs = packed_microbatches(samples(), list(range(5)), 16)
    for mb in mbs:
        cu = mb.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == 16
        for a, b in zip(cu[:-1], cu[1:]):
            assert mb.position_ids[0, a:b].tolist() == list(range(b - a)) or mb.loss_mask[0, a:b].sum() == 0


def test_block_causal_mask():
    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 5)[0, 0]
    allowed = ~mask
    assert allowed[1, 0] and not allowed[0, 1]  # causal inside a segment
    assert not allowed[2, 1] and allowed[4, 2]  # nothing across segments


def test_pack_bins_respects_capacity_and_keeps_everything():
    lengths = [5, 9, 3, 7, 7, 2, 8]
    bins = pack_bins(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    with pytest.raises(ValueError, match="seq_len"):
        pack_bins([11], 10)


def test_data_parallel_split_is_a_balanced_partition():
    data = samples()
    parts = [split_for_data_parallel(data, 2, r) for r in range(2)]
    ids = sorted(i for _, idx in parts for i in idx)
    assert ids == list(range(len(data)))
    loads = [sum(len(s.tokens) for s in part) for part, _ in parts]
    assert abs(loads[0] - loads[1]) <= max(len(s.tokens) for s in data)


def test_bad_sample_is_rejected():
    with pytest.raises(ValueError, match="behaviour log-probs"):
        TrainSample([1, 2, 3], 1, [-1.0], 0.0)


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_ranks_hold_two_balanced_chunks_of_every_segment_and_together_the_row(cp):
    """Segments padded to multiples of 2cp; rank r holds chunks r and 2cp-1-r of each (as Megatron's
    RoPE and TE expect), the ranks' positions partition the row, and every completion token is scored
    on exactly one rank with its label and behaviour log-prob."""
    data = samples()
    mbs = packed_microbatches(data, list(range(5)), 24 * cp, align=2 * cp)
    for mb in mbs:
        cu = mb.cu_seqlens.tolist()
        assert all((b - a) % (2 * cp) == 0 for a, b in zip(cu[:-1], cu[1:]))
        held = [cp_positions(mb.cu_seqlens, cp, r) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(cu[-1]))
        a, b = cu[0], cu[1]
        c = (b - a) // (2 * cp)
        assert held[0][:2 * c].tolist() == list(range(a, a + c)) + list(range(b - c, b))  # first and last chunks
        shards = [cp_shard(mb, cp, r) for r in range(cp)]
        assert all(s.tokens.shape[1] == cu[-1] // cp and torch.equal(s.cu_seqlens, mb.cu_seqlens) for s in shards)
        for j in range(len(mb.sample_ids)):
            scored = []  # (position in the row, label) of sequence j's loss tokens, from every rank
            for shard, pos in zip(shards, held):
                sel = (shard.loss_mask & (shard.seq == j))[0]
                scored += zip(pos[sel].tolist(), shard.labels[0, sel].tolist())
            assert [lab for _, lab in sorted(scored)] == [lab for lab, _ in _scored(mb, j)]


def test_context_parallel_packing_refuses_rows_it_cannot_split():
    with pytest.raises(ValueError, match="multiple of 4"):
        packed_microbatches(samples(), list(range(5)), 18, align=4)
    (mb,) = packed_microbatches(samples()[:1], [0], 16)  # a 7-token segment, not padded
    with pytest.raises(ValueError, match="cannot be split into 2 x cp = 4 chunks"):
        cp_shard(mb, 2, 0)
    padded = padded_microbatches(samples(), list(range(5)), 2, 16)[0]
    with pytest.raises(ValueError, match="trainer.packing=true"):
        cp_shard(padded, 2, 0)
