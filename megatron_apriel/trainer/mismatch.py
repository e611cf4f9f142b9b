"""Train/inference mismatch per server: each server's fresh-token drift over a step.

The loss gives, per sequence, the drift summed over its fresh tokens (`fresh_drift_by_sequence`,
pure); the step adds these up by the server that generated each sequence, over its micro-batches
and the ranks that hold other sequences (`server_drift`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_apriel.trainer.batch import MicroBatch
from megatron_apriel.trainer.loss import LossInputs


def fresh_drift_by_sequence(inp: LossInputs) -> torch.Tensor:
    """``[S, 2]`` fp64: per sequence, the sum of |log pi - log mu| over its fresh loss tokens and how
    many there are (the step adds them up per server: a server's numeric drift)."""
    n_seq = inp.adv_S.shape[0]
    fresh = inp.mask_N & (inp.fresh_N if inp.fresh_N is not None else torch.zeros_like(inp.mask_N))
    fresh_N = fresh.double()  # a weight, not a boolean index: no device-to-host sync in the schedule
    drift_N = (inp.logp_N.detach() - inp.old_logp_N).abs().double() * fresh_N
    seq = inp.seq_N.clamp(0, n_seq - 1)
    return torch.stack([drift_N.new_zeros(n_seq).index_add(0, seq, drift_N),
                        drift_N.new_zeros(n_seq).index_add(0, seq, fresh_N)], dim=1)


PER_SEQ_FRESH = "per_seq_fresh"
"""The loss's per-sequence fresh drift ``[S, 2]``, taken out of the scalar metrics by `server_drift`."""


def server_key(url: str) -> str:
    """A server's name in metric keys: its URL without the scheme (``127.0.0.1:8000``)."""
    return url.split("://", 1)[-1].rstrip("/")


def server_drift(per_mb: list[dict], microbatches: list[MicroBatch], group) -> dict[str, float]:
    """Each server's fresh-token drift over the step: mean |log pi - log mu| on the tokens it sampled
    with the weights being trained (``mismatch/server/<host:port>/fresh_abs_log_rho``, ``.../fresh_tokens``),
    summed over this rank's micro-batches, then over ``group`` (the ranks holding other sequences or
    other parts of them)."""
    mine = [(server, drift, tokens) for m, mb in zip(per_mb, microbatches)
            for server, (drift, tokens) in zip(mb.servers, m.pop(PER_SEQ_FRESH).tolist()) if server and tokens]
    everyone = [mine]
    if group is not None:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    merged: dict[str, list[float]] = {}
    for server, drift, tokens in (row for part in everyone for row in part):
        total = merged.setdefault(server, [0.0, 0.0])
        total[0], total[1] = total[0] + drift, total[1] + tokens
    out = {}
    for server, (drift, tokens) in sorted(merged.items()):
        out[f"mismatch/server/{server_key(server)}/fresh_abs_log_rho"] = drift / tokens
        out[f"mismatch/server/{server_key(server)}/fresh_tokens"] = tokens
    return out
