"""Expert routing of one MoE model stage: replayed, recorded, counted. Model code: no process groups.

Every ``TopKRouter`` of the stage gets a :class:`RouterTap` as its ``router_replay`` (the object
Megatron-Core 0.16 to 0.19 asks for its top-k: ``get_replay_topk(scores, topk, num_groups,
group_topk, default_compute_topk)``). The tap always computes the router's own top-k, then:

- **replays** the experts the rollout engine chose for the token, when the micro-batch carries them
  (rollout routing replay, R3: arXiv 2510.11370): the tokens go to vLLM's experts and the combine
  weights are the router's own scores at those experts, so the router still gets gradients;
  a row with ``-1`` (a token vLLM never routed: the last sampled one, padding) keeps its own choice;
- counts, per MoE layer, the tokens each expert received (the experts used: replayed ones when
  replaying) and, on the positions the micro-batch marks ``fresh``, how often the router's own
  top-k *set* differs from vLLM's (the routing mismatch, measured whether replay is on or off),
  also per sequence of each micro-batch (the trainer adds them up by the server that generated
  the sequence: each server's routing mismatch).

Token order inside a router: Megatron flattens hidden states ``[S, b, H]`` sequence-first, so row
``s * b + i`` is position ``s`` of row ``i``; under sequence parallelism a tensor-parallel rank
routes its own contiguous slice of ``S``.

Activation recomputation (``model.recompute=full``) runs each layer's forward again during the
backward pass: there the tap replays the micro-batches in the order of their first forwards
(Megatron's schedules run backward passes in the order of the forward passes), and counts nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch

UNROUTED = -1
"""An expert id meaning "no replay for this token": the router's own choice is used."""


class RouterTap:
    """Stands in for Megatron's ``RouterReplay`` on one router (see the module docstring)."""

    def __init__(self, routing: "StageRouting", slot: int):
        self.routing, self.slot = routing, slot
        self.layer_number: Optional[int] = None  # Megatron 0.19 sets it on whatever router_replay is
        self.pending: deque = deque()  # targets kept for the recomputation of earlier micro-batches

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None,
                        default_compute_topk: Optional[Callable] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``scores [N, E]`` -> (``scores`` at the chosen experts ``[N, k]``, chosen experts ``[N, k]``)."""
        values, own_NK = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recomputing = self.routing.recompute and torch.is_grad_enabled() and self.pending
        target_NK = self.pending.popleft() if recomputing else self.routing.target(self.slot, scores.shape[0])
        chosen_NK = own_NK if target_NK is None else torch.where(target_NK >= 0, target_NK, own_NK)
        if not recomputing:
            if self.routing.recompute and self.routing.training:
                self.pending.append(target_NK)
            self.routing.count(self.slot, own_NK, chosen_NK)
        if target_NK is None:
            return values, own_NK
        return scores.gather(1, chosen_NK), chosen_NK


class StageRouting:
    """The taps of one model stage, the current micro-batch's routing inputs and the step's counts.

    Per micro-batch, before its forward: :meth:`begin`. After the step: :meth:`take_counts`.
    """

    def __init__(self, model, *, moe_layers: list[int], num_experts: int, replay: bool):
        """``moe_layers``: the model's sparse layers (global indices, in order); the micro-batch's
        routing ``[b, S, len(moe_layers), k]`` is indexed by position in this list."""
        self.num_experts, self.replay = num_experts, replay
        self.recompute = model.config.recompute_granularity == "full"
        self.sequence_parallel = model.config.sequence_parallel
        self.slots: list[int] = []  # per tap: its index in moe_layers
        self.taps: list[RouterTap] = []
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            self.slots.append(moe_layers.index(layer.layer_number - 1))
            self.taps.append(RouterTap(self, len(self.taps)))
            router.router_replay = self.taps[-1]
        n = len(moe_layers)
        self.counts = {"expert_tokens": torch.zeros(n, num_experts), "tokens": torch.zeros(n),
                       "mismatch": torch.zeros(n), "compared": torch.zeros(n)}
        self.per_sequence: list[torch.Tensor] = []
        """Per training micro-batch, in forward order: ``[n_seq, 2]`` fp64 (mismatched, compared)
        (token, MoE layer) pairs of each of its sequences, on the device until the step reads them."""
        self.training = False
        self._mb: dict = {}
        self._tp = (1, 0)

    def begin(self, *, routing: Optional[torch.Tensor], valid: torch.Tensor, fresh: torch.Tensor, training: bool,
              tp: tuple[int, int] = (1, 0), seq: Optional[torch.Tensor] = None, n_seq: int = 0) -> None:
        """Inputs of the next micro-batch's forward: ``routing [b, S, L, k]`` vLLM's experts (``-1``
        where unknown; None: none recorded), ``valid [b, S]`` real tokens, ``fresh [b, S]`` positions
        whose routing the trained weights computed in vLLM; ``tp``: (size, rank) for sequence
        parallelism; ``seq [b, S]`` each position's sequence among the micro-batch's ``n_seq`` (the
        per-sequence mismatch counts; None: not kept)."""
        self.training, self._tp = training, tp
        self._mb = {"routing": self._tokens(routing), "valid": self._tokens(valid), "fresh": self._tokens(fresh),
                    "seq": self._tokens(seq)}
        if training and seq is not None:  # one entry per training micro-batch (zeros when nothing is compared)
            self._mb["per_seq"] = torch.zeros(n_seq, 2, dtype=torch.float64, device=seq.device)
            self.per_sequence.append(self._mb["per_seq"])

    def end(self) -> None:
        """After the last micro-batch of a schedule: a later forward (e.g. sampling from the model)
        routes by itself."""
        self._mb, self.training = {}, False

    def _tokens(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``[b, S, ...]`` -> this rank's router rows ``[N, ...]`` (sequence-first, SP slice)."""
        if t is None:
            return None
        rows = t.transpose(0, 1)  # [S, b, ...]
        if self.sequence_parallel and self._tp[0] > 1:
            size, rank = self._tp
            per = rows.shape[0] // size
            rows = rows[rank * per:(rank + 1) * per]
        return rows.reshape(-1, *rows.shape[2:])

    def target(self, slot: int, n: int) -> Optional[torch.Tensor]:
        """The experts to replay at tap ``slot`` ``[N, k]``, or None (replay off or nothing recorded)."""
        routing = self._mb.get("routing")
        if not self.replay or routing is None:
            return None
        assert routing.shape[0] == n, f"routing for {routing.shape[0]} tokens, router sees {n}"
        return routing[:, self.slots[slot]].long()

    @torch.no_grad()
    def count(self, slot: int, own_NK: torch.Tensor, chosen_NK: torch.Tensor) -> None:
        """Expert load from the experts used (``chosen``), mismatch from the router's own choice."""
        if not self._mb or not self.training:
            return
        layer = self.slots[slot]
        valid = self._mb["valid"]
        used = torch.zeros(chosen_NK.shape[0], self.num_experts, dtype=torch.bool, device=chosen_NK.device)
        used.scatter_(1, chosen_NK, True)
        self.counts["expert_tokens"][layer] += used[valid].sum(0).float().cpu()
        self.counts["tokens"][layer] += float(valid.sum())
        routing = self._mb["routing"]
        if routing is None:
            return
        vllm_NK = routing[:, layer].long()
        compare = self._mb["fresh"] & (vllm_NK >= 0).all(-1)
        differs = (own_NK.sort(-1).values != vllm_NK.sort(-1).values).any(-1)
        self.counts["mismatch"][layer] += float((differs & compare).sum())
        self.counts["compared"][layer] += float(compare.sum())
        per_seq = self._mb.get("per_seq")
        if per_seq is not None:
            pairs_N2 = torch.stack([differs & compare, compare], dim=1).double()
            per_seq.index_add_(0, self._mb["seq"].clamp(0, per_seq.shape[0] - 1), pairs_N2)

    def take_sequence_counts(self) -> list[torch.Tensor]:
        """The per-sequence mismatch counts of this step's training micro-batches (`per_sequence`), then reset."""
        out, self.per_sequence = self.per_sequence, []
        return out

    def take_counts(self) -> dict[str, torch.Tensor]:
        """This rank's counts since the last call (summed over ranks by the caller), then reset."""
        out = {k: v.clone() for k, v in self.counts.items()}
        for v in self.counts.values():
            v.zero_()
        for tap in self.taps:
            assert not tap.pending, "a recomputation did not consume its micro-batch's routing"
        self.end()
        return out


def routing_metrics(counts: dict[str, torch.Tensor], top_k: int) -> dict[str, float]:
    """Per-step MoE metrics from counts summed over every rank: ``moe/busiest_expert_share`` (the
    share of a layer's tokens its busiest expert received; ``top_k / num_experts`` is perfect
    balance, 1 means every token went to it), mean and max over layers, and
    ``train/routing_mismatch``: the share of compared (fresh token, MoE layer) pairs whose top-k set
    from vLLM differs from the trainer's own (NaN when nothing was compared)."""
    tokens = counts["tokens"].clamp(min=1)
    busiest = counts["expert_tokens"].max(dim=1).values / tokens
    seen = counts["tokens"] > 0
    out = {"moe/busiest_expert_share_mean": float(busiest[seen].mean()) if seen.any() else float("nan"),
           "moe/busiest_expert_share_max": float(busiest[seen].max()) if seen.any() else float("nan"),
           "moe/balanced_share": float(top_k / counts["expert_tokens"].shape[1])}
    compared = float(counts["compared"].sum())
    out["train/routing_mismatch"] = float(counts["mismatch"].sum()) / compared if compared else float("nan")
    out["train/routing_compared"] = compared
    return out
