"""The vLLM fleet for an output budget, and what each weight update moves (pure arithmetic).

A server holds the bf16 weights split over its TP GPUs and a KV cache of
``2 * layers * kv_heads * head_dim * 2`` bytes per token (K and V, bf16) for every sequence in
flight; a sequence can reach ``trainer.seq_len`` tokens (prompt + output budget). Each server
gets the smallest TP (a power of two within a node that divides the heads) whose KV cache holds
``min_sequences`` full-length sequences. A weight update sends, from every pipeline stage, that
stage's full (TP-gathered) weights in bf16 (a MoE stage from ``ep`` sources, each its own
experts); sources send in parallel, so the update takes as long as the largest one at the given
bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_apriel.model.arch import ModelArch
from megatron_apriel.plan.params import StageShape, stage_params

BF16 = 2
GIB = 2 ** 30


@dataclass(frozen=True)
class FleetPlan:
    servers: int
    tp_per_server: int
    weights_per_gpu_gib: float
    kv_cache_per_server_gib: float
    kv_bytes_per_token: int
    full_sequences_per_server: int
    fleet_full_sequences: int

    def to_dict(self) -> dict:
        return asdict(self)


def kv_bytes_per_token(arch: ModelArch, kv_bytes: int = BF16) -> int:
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * kv_bytes


def weights_bytes(arch: ModelArch, dtype_bytes: int = BF16) -> int:
    """The HF model's weights (true vocabulary) in ``dtype_bytes``."""
    return sum(n for _, n in stage_params(arch, StageShape(tp=1, pp=1, stage=0, vocab_divisible_by=1))) * dtype_bytes


def plan_fleet(arch: ModelArch, *, gpus: int, gpus_per_node: int, gpu_memory_gib: float, memory_utilization: float,
               seq_len: int, min_sequences: int) -> FleetPlan:
    """The smallest server TP that holds ``min_sequences`` sequences of ``seq_len`` tokens. Above
    the KV heads' count, vLLM gives every GPU one KV head (replicated): the KV cache then grows."""
    per_token = kv_bytes_per_token(arch)
    weights = weights_bytes(arch)
    for tp in (1, 2, 4, 8, 16):
        kv_heads = max(arch.num_kv_heads, tp)
        if tp > min(gpus_per_node, gpus) or arch.num_heads % tp or kv_heads % tp or kv_heads % arch.num_kv_heads:
            continue
        kv = tp * (gpu_memory_gib * GIB * memory_utilization - weights / tp)
        per_token = kv_bytes_per_token(arch) * kv_heads // arch.num_kv_heads
        sequences = int(kv // (per_token * seq_len)) if kv > 0 else 0
        if sequences >= min_sequences:
            servers = gpus // tp
            return FleetPlan(servers, tp, weights / tp / GIB, kv / tp / GIB, per_token, sequences, servers * sequences)
    raise ValueError(
        f"no vLLM server of up to {min(gpus_per_node, gpus)} GPUs holds {min_sequences} sequences of {seq_len} tokens "
        f"({per_token * seq_len / GIB:.1f} GiB of KV cache each) beside {weights / GIB:.0f} GiB of weights: give the "
        "fleet larger GPUs, lower trainer.seq_len, or lower rollout.group_size.")


def stage_update_bytes(arch: ModelArch, pp: int, ep: int = 1) -> list[int]:
    """Bytes of bf16 weights each pipeline stage's largest source sends to the fleet in one update
    (a MoE stage has ``ep`` sources, each sending its own experts; the first also the dense weights)."""
    def sent(name: str) -> bool:  # a tied head's copy on the last stage is not an HF tensor
        return not (arch.tie_embeddings and name == "output_layer.weight")

    return [sum(n for name, n in stage_params(arch, StageShape(tp=1, pp=pp, stage=s, vocab_divisible_by=1, ep=ep))
                if sent(name)) * BF16 for s in range(pp)]
