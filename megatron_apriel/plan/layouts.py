"""Every valid trainer layout for a model and a cluster, its memory per GPU, and a recommendation.

A mixture of experts adds the expert-parallel size ``ep`` (dividing the experts and tp * dp; MoE
under tp > 1 needs sequence parallelism, as Megatron does). Per GPU and pipeline stage: weights,
gradients and distributed-optimizer state are exact (see
:mod:`.buffers`; the worst data-parallel rank); activations are an estimate (see
:mod:`.activations`) for one packed row of ``seq_len`` tokens per micro-batch, with ``pp - stage``
micro-batches in flight under 1F1B; the last stage adds the log-prob head. A layout fits with a
recomputation setting when every stage's total stays under the usable memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megatron_apriel.model.arch import ModelArch
from megatron_apriel.parallel.dims import cp_alignment
from megatron_apriel.plan.activations import ActivationShape, head_bytes, stage_activation_bytes
from megatron_apriel.plan.buffers import worst_rank_state
from megatron_apriel.plan.params import StageShape
from megatron_apriel.trainer.config import LOGPROB_CHUNK_TOKENS

GIB = 2 ** 30
RECOMPUTE_ORDER = (None, "selective", "full")


@dataclass(frozen=True)
class TrainerSettings:
    """What the run config decides about the trainer's memory."""

    seq_len: int
    param_bytes: int = 2
    """2 for bf16 weights (the GPU path), 4 for fp32."""
    sequence_parallel: bool = True
    """Applied to layouts with tp > 1."""
    spec: str = "transformer_engine"
    kernels: str = "te"
    vocab_divisible_by: int = 128
    logprob_chunk_tokens: int = LOGPROB_CHUNK_TOKENS
    """``trainer.logprob_chunk_tokens`` (0: the full logits)."""


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int = 1
    cp: int = 1
    weights_gib: float = 0.0
    grads_gib: float = 0.0
    optimizer_gib: float = 0.0
    activations_gib: dict = field(default_factory=dict)
    """Recompute setting (none / selective / full) -> activations of the worst stage (estimate)."""
    logits_gib: float = 0.0
    """The last stage's log-prob head at its peak (estimate)."""
    total_gib: dict = field(default_factory=dict)
    """Recompute setting -> the worst stage's total."""
    fits: list = field(default_factory=list)
    """Recompute settings under which every stage fits."""

    def to_dict(self) -> dict:
        return asdict(self)


def _key(recompute) -> str:
    return recompute or "none"


CP_SIZES = (1, 2, 4, 8)


def candidate_layouts(arch: ModelArch, gpus: int, gpus_per_node: int, sequence_parallel: bool = True,
                      seq_len: int = 0) -> list[tuple[int, int, int, int, int]]:
    """(tp, pp, dp, ep, cp) with tp inside a node dividing the heads, KV heads and MLP, pp dividing
    the layers, cp splitting ``seq_len`` into 2 x cp chunks (x tp with sequence parallelism), and for
    a MoE model ep dividing the experts and tp * cp * dp (tp > 1 only with sequence parallelism)."""
    out = []
    for tp in (t for t in (1, 2, 4, 8, 16) if t <= gpus_per_node):
        if arch.num_heads % tp or arch.num_kv_heads % tp or arch.ffn_hidden_size % tp:
            continue
        if arch.is_moe and tp > 1 and not sequence_parallel:
            continue
        for pp in range(1, arch.num_layers + 1):
            if arch.num_layers % pp:
                continue
            for cp in CP_SIZES:
                if gpus % (tp * pp * cp) or seq_len % cp_alignment(cp, tp, sequence_parallel):
                    continue
                dp = gpus // (tp * pp * cp)
                eps = [e for e in range(1, arch.num_experts + 1)
                       if arch.num_experts % e == 0 and (tp * cp * dp) % e == 0]
                out += [(tp, pp, dp, ep, cp) for ep in (eps if arch.is_moe else [1])]
    return out


def size_layout(arch: ModelArch, tp: int, pp: int, dp: int, s: TrainerSettings, usable_gib: float,
                ep: int = 1, cp: int = 1) -> Layout:
    """A layout's memory per GPU. Context parallelism splits every row's tokens (activations and the
    head) over ``cp`` ranks, which hold the same weights and shard the optimizer with the DP ranks."""
    act = ActivationShape(tokens=s.seq_len // cp, tp=tp, dtype_bytes=s.param_bytes,
                          sequence_parallel=s.sequence_parallel and tp > 1, kernels=s.kernels,
                          logprob_chunk_tokens=s.logprob_chunk_tokens)
    head = head_bytes(arch, act, s.vocab_divisible_by)
    layout = Layout(tp, pp, dp, ep, cp, logits_gib=(head["kept"] + head["peak_extra"]) / GIB)
    # the middle stages are alike (a MoE model's dense layers may sit anywhere: every stage then)
    stages = sorted({0, pp // 2, pp - 1}) if not arch.dense_layers else list(range(pp))
    states = {st: worst_rank_state(arch, StageShape(tp, pp, st, s.spec, s.vocab_divisible_by, ep), dp * cp,
                                   s.param_bytes)
              for st in stages}
    worst = max(states.values(), key=lambda x: x.total)
    layout.weights_gib, layout.grads_gib, layout.optimizer_gib = (worst.weights / GIB, worst.grads / GIB,
                                                                  worst.optimizer / GIB)
    for rec in RECOMPUTE_ORDER:
        per_stage = {st: stage_activation_bytes(arch, act, pp=pp, stage=st, recompute=rec) for st in stages}
        totals = {st: states[st].total + per_stage[st] + (head["kept"] + head["peak_extra"] if st == pp - 1 else 0)
                  for st in stages}
        layout.activations_gib[_key(rec)] = max(per_stage.values()) / GIB
        layout.total_gib[_key(rec)] = max(totals.values()) / GIB
        if layout.total_gib[_key(rec)] <= usable_gib:
            layout.fits.append(_key(rec))
    return layout


def plan_layouts(arch: ModelArch, gpus: int, gpus_per_node: int, s: TrainerSettings, usable_gib: float) -> list[Layout]:
    return [size_layout(arch, tp, pp, dp, s, usable_gib, ep, cp)
            for tp, pp, dp, ep, cp in candidate_layouts(arch, gpus, gpus_per_node, s.sequence_parallel, s.seq_len)]


def recommend(layouts: list[Layout]) -> tuple[Layout, str] | None:
    """The fitting layout with the least recomputation, then the most data parallelism, then the
    fewest pipeline stages (fewer bubbles), then the smallest expert parallelism (less token
    exchange); None when nothing fits. Context parallelism comes right after recomputation: the least
    CP that fits with the least recomputation (its communication is not sized here, so it is taken
    only where it saves recomputation, as for long sequences)."""
    options = [(RECOMPUTE_ORDER.index(None if rec == "none" else rec), lay.cp, lay.tp * lay.pp * lay.cp, lay.pp,
                lay.tp, lay.ep, rec, i)
               for i, lay in enumerate(layouts) for rec in lay.fits[:1]]
    if not options:
        return None
    best = min(options)
    return layouts[best[-1]], best[-2]
