"""Turn a step's samples into micro-batches: padded rows or packed (THD) rows.

A sample is one rollout: prompt + completion token ids, the behaviour log-prob of every model
token (from vLLM) and the sequence's advantage. Position p of a row predicts token p + 1 of the
same sequence, so a completion token at index j is scored at position j - 1. In a multi-turn
trajectory only the model's tokens are scored (``loss_mask``); the environment's tokens between
its turns go through the forward pass as context (their routed experts, if recorded, replayed
like the prompt's), with no loss, drift or mismatch figure.

Padded: ``[b, S]`` rows, right-padded, plain causal attention.
Packed: ``[1, T]`` rows holding several sequences back to back, described by
``PackedSeqParams(qkv_format="thd", cu_seqlens=...)``; attention stays inside each sequence and
RoPE positions restart per sequence (TE on GPU, ``model.attention`` on CPU). The unused tail of
a row is one more, loss-free segment. Both give the same log-probs for the same samples.

Context parallelism (packed rows only): every segment is padded to a multiple of 2 x cp positions
(``align``) and :func:`cp_shard` keeps this CP rank's two chunks of each (chunk ``r`` and chunk
``2cp - 1 - r`` of 2cp, Megatron's load-balanced split for causal attention); ``cu_seqlens`` stay
those of the whole row, as Megatron's RoPE and TE's attention expect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from megatron_apriel.parallel.context import cp_positions
from megatron_apriel.records.samples import TrainSample, balance_by_tokens


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, S] int64
    position_ids: torch.Tensor  # [b, S] int64
    labels: torch.Tensor  # [b, S] int64: next token (0 where no loss)
    loss_mask: torch.Tensor  # [b, S] bool: positions that predict a model token (environment tokens: False)
    old_logp: torch.Tensor  # [b, S] float32: behaviour log-prob of labels (0 where no loss)
    fresh: torch.Tensor  # [b, S] bool: loss positions whose token the trained weights sampled themselves, over
    #                                 a KV cache they computed themselves (not a stale cache: ``stale_cache``)
    stale_cache: torch.Tensor  # [b, S] bool: loss positions sampled over KV of older weights (kv_on_update=keep)
    lag: torch.Tensor  # [b, S] int32: at loss positions, versions between the token's weights and the trained ones
    seq: torch.Tensor  # [b, S] int64: index of the position's sequence in this micro-batch
    advantages: torch.Tensor  # [n_seq] float32
    truncated: torch.Tensor  # [n_seq] bool
    valid: Optional[torch.Tensor] = None  # [b, S] bool: positions that hold a sequence's token (not padding)
    routing: Optional[torch.Tensor] = None  # [b, S, L_moe, k] int16: vLLM's experts, -1 unknown (MoE only)
    cu_seqlens: Optional[torch.Tensor] = None  # [n_segments + 1] int32, packed rows only
    max_seqlen: int = 0
    sample_ids: list[int] = field(default_factory=list)  # index of each sequence in the step
    servers: list[str] = field(default_factory=list)  # the server that generated each sequence ("": none)

    def to(self, device) -> "MicroBatch":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**moved)

    def packed_seq_params(self):
        if self.cu_seqlens is None:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)


def _fill_row(row: dict, start: int, s: TrainSample, seq_index: int) -> None:
    n = len(s.tokens)
    row["tokens"][start : start + n] = torch.from_numpy(s.tokens)
    row["position_ids"][start : start + n] = torch.arange(n)
    # positions prompt_len-1 .. n-2 predict the completion tokens prompt_len .. n-1; those of the
    # model's tokens carry the loss, the environment's are context only
    first, last = start + s.prompt_len - 1, start + n - 1
    model = torch.from_numpy(s.completion_mask())
    row["labels"][first:last] = torch.from_numpy(s.tokens[s.prompt_len :])
    row["loss_mask"][first:last] = model
    row["old_logp"][first:last][model] = torch.from_numpy(s.behaviour_logprobs)
    row["lag"][first:last][model] = torch.from_numpy(s.lags)
    if s.stale_cache is not None:
        row["stale_cache"][first:last][model] = torch.from_numpy(s.stale_cache)
    row["fresh"][first:last] = model & (row["lag"][first:last] == 0) & ~row["stale_cache"][first:last]
    row["seq"][start : start + n] = seq_index
    row["valid"][start : start + n] = True
    if s.routing is not None:
        row["routing"][start : start + n] = torch.from_numpy(s.routing.astype(np.int16, copy=False))


def _empty_rows(b: int, length: int, samples: list[TrainSample]) -> dict:
    routed = [s.routing for s in samples if s.routing is not None]
    if routed and len(routed) != len(samples):
        raise ValueError("some samples of a micro-batch carry routed experts and others do not: record them for "
                         "every rollout (rollout.routing_replay) or for none.")
    rows = _plain_rows(b, length)
    if routed:
        rows["routing"] = torch.full((b, length, *routed[0].shape[1:]), -1, dtype=torch.int16)
    return rows


def _plain_rows(b: int, length: int) -> dict:
    return {
        "tokens": torch.zeros(b, length, dtype=torch.long),
        "position_ids": torch.zeros(b, length, dtype=torch.long),
        "labels": torch.zeros(b, length, dtype=torch.long),
        "loss_mask": torch.zeros(b, length, dtype=torch.bool),
        "old_logp": torch.zeros(b, length, dtype=torch.float32),
        "fresh": torch.zeros(b, length, dtype=torch.bool),
        "stale_cache": torch.zeros(b, length, dtype=torch.bool),
        "lag": torch.zeros(b, length, dtype=torch.int32),
        "seq": torch.zeros(b, length, dtype=torch.long),
        "valid": torch.zeros(b, length, dtype=torch.bool),
    }


def _per_seq(samples: list[TrainSample]) -> dict:
    return {
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        "truncated": torch.tensor([s.truncated for s in samples], dtype=torch.bool),
        "servers": [s.server for s in samples],
    }


def padded_microbatches(samples: list[TrainSample], ids: list[int], micro_batch_size: int,
                        seq_len: int) -> list[MicroBatch]:
    """Right-padded ``[micro_batch_size, seq_len]`` micro-batches (the last may be smaller)."""
    too_long = [len(s.tokens) for s in samples if len(s.tokens) > seq_len]
    if too_long:
        raise ValueError(f"sample of {max(too_long)} tokens exceeds trainer.seq_len={seq_len}; raise it.")
    out = []
    for lo in range(0, len(samples), micro_batch_size):
        chunk = samples[lo : lo + micro_batch_size]
        rows = _empty_rows(micro_batch_size, seq_len, chunk)  # PP needs one shape: short chunks get empty rows
        for i, s in enumerate(chunk):
            one = {k: v[i] for k, v in rows.items()}
            _fill_row(one, 0, s, i)
        out.append(MicroBatch(**rows, **_per_seq(chunk), sample_ids=ids[lo : lo + micro_batch_size]))
    return out


def pack_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices grouped into bins whose lengths sum to <= capacity."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > capacity:
            raise ValueError(f"sample of {lengths[i]} tokens exceeds trainer.seq_len={capacity}; raise it.")
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def packed_microbatches(samples: list[TrainSample], ids: list[int], pack_len: int, *,
                        align: int = 1) -> list[MicroBatch]:
    """``[1, pack_len]`` rows, each packing several sequences (THD layout); each sequence takes a
    multiple of ``align`` positions (2 x cp under context parallelism; the extra ones carry no loss)."""
    if pack_len % align:
        raise ValueError(f"trainer.seq_len={pack_len} must be a multiple of {align} (2 x parallel.cp, times "
                         "parallel.tp with sequence parallelism); raise it to the next multiple.")
    out = []
    for members in pack_bins([_aligned(len(s.tokens), align) for s in samples], pack_len):
        chunk = [samples[i] for i in members]
        rows = _empty_rows(1, pack_len, chunk)
        row = {k: v[0] for k, v in rows.items()}
        bounds, start = [0], 0
        for j, s in enumerate(chunk):
            _fill_row(row, start, s, j)
            n = _aligned(len(s.tokens), align)
            row["seq"][start + len(s.tokens):start + n] = j
            row["position_ids"][start + len(s.tokens):start + n] = torch.arange(len(s.tokens), n)
            start += n
            bounds.append(start)
        if start < pack_len:  # the unused tail is a loss-free segment of its own
            row["seq"][start:] = len(chunk) - 1
            bounds.append(pack_len)
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        out.append(MicroBatch(**rows, **_per_seq(chunk), cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
                              max_seqlen=max(lengths), sample_ids=[ids[i] for i in members]))
    return out


def cp_shard(mb: MicroBatch, cp: int, cp_rank: int) -> MicroBatch:
    """This CP rank's share of a packed micro-batch: its positions of every per-position tensor;
    the per-sequence tensors and the row's ``cu_seqlens`` whole."""
    if cp == 1:
        return mb
    if mb.cu_seqlens is None:
        raise ValueError("context parallelism splits packed rows: set trainer.packing=true with parallel.cp > 1.")
    where = cp_positions(mb.cu_seqlens, cp, cp_rank)
    fields = {k: (v[:, where] if isinstance(v, torch.Tensor) and v.dim() >= 2 else v) for k, v in mb.__dict__.items()}
    return MicroBatch(**fields)


def split_for_data_parallel(samples: list[TrainSample], dp: int, dp_rank: int) -> tuple[list[TrainSample], list[int]]:
    """This DP rank's share, balanced by token count (greedy, deterministic), with step indices."""
    mine = balance_by_tokens([len(s.tokens) for s in samples], dp)[dp_rank]
    return [samples[i] for i in mine], mine
