"""Train/inference mismatch per server: each server's fresh-token drift and, for a mixture of
experts, its routing mismatch over a step.

The loss gives, per sequence, the drift summed over its fresh tokens (`fresh_drift_by_sequence`,
pure); the step adds these up by the server that generated each sequence, over its micro-batches
and the ranks that hold other sequences (`server_drift`). The MoE routing taps count, per sequence,
the (fresh token, MoE layer) pairs whose expert set differs from vLLM's (`model.routing`); the step
adds them up by server over every rank (`server_routing`: pipeline stages hold other layers).
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


def _merge(rows: list[tuple[str, float, float]], group) -> dict[str, list[float]]:
    """``(server, a, b)`` rows of every rank of ``group`` (None: this rank's alone), summed per server."""
    everyone = [rows]
    if group is not None:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, rows, group=group)
    merged: dict[str, list[float]] = {}
    for server, a, b in (row for part in everyone for row in part):
        total = merged.setdefault(server, [0.0, 0.0])
        total[0], total[1] = total[0] + a, total[1] + b
    return merged


def server_drift(per_mb: list[dict], microbatches: list[MicroBatch], group) -> dict[str, float]:
    """Each server's fresh-token drift over the step: mean |log pi - log mu| on the tokens it sampled
    with the weights being trained (``mismatch/server/<host:port>/fresh_abs_log_rho``, ``.../fresh_tokens``),
    summed over this rank's micro-batches, then over ``group`` (the ranks holding other sequences or
    other parts of them)."""
    mine = [(server, drift, tokens) for m, mb in zip(per_mb, microbatches)
            for server, (drift, tokens) in zip(mb.servers, m.pop(PER_SEQ_FRESH).tolist()) if server and tokens]
    out = {}
    for server, (drift, tokens) in sorted(_merge(mine, group).items()):
        out[f"mismatch/server/{server_key(server)}/fresh_abs_log_rho"] = drift / tokens
        out[f"mismatch/server/{server_key(server)}/fresh_tokens"] = tokens
    return out


def server_routing(per_mb: list[torch.Tensor], microbatches: list[MicroBatch]) -> dict[str, float]:
    """Each server's routing mismatch over the step: the share of compared (fresh token, MoE layer)
    pairs whose top-k set from vLLM differs from the trainer's own
    (``mismatch/server/<host:port>/routing_mismatch``, ``.../routing_compared``). ``per_mb``: the
    routing taps' per-sequence counts of this rank's training micro-batches, in their order; summed
    over every rank (a collective: every rank calls it). Each pair is counted once: a MoE under tensor
    parallelism needs sequence parallelism (``model/provider.moe_kwargs`` refuses it otherwise), so each
    TP rank's routers see only its slice of the positions."""
    mine = [(server, mismatched, compared) for counts, mb in zip(per_mb, microbatches)
            for server, (mismatched, compared) in zip(mb.servers, counts.tolist()) if server and compared]
    out = {}
    world = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    for server, (mismatched, compared) in sorted(_merge(mine, world).items()):
        out[f"mismatch/server/{server_key(server)}/routing_mismatch"] = mismatched / compared
        out[f"mismatch/server/{server_key(server)}/routing_compared"] = compared
    return out
