"""Settings of the model and its optimizer (``model.*``, ``optim.*``). A leaf: standard library only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_apriel.choices import Fp8Format, Fp8Recipe, TokenDispatcher, check_choice, choices
from megatron_apriel.model.arch import ModelArch

FP8_FORMATS = choices(Fp8Format)


FP8_RECIPES = choices(Fp8Recipe)
DISPATCHERS = choices(TokenDispatcher)


@dataclass(kw_only=True)
class MoEConfig:
    """How the trainer runs a mixture-of-experts model (``model.moe.*``; ignored for dense ones).

    The router losses default to 0, as slime trains Qwen3-30B-A3B with RL
    (``scripts/models/qwen3-30B-A3B.sh``: ``--moe-aux-loss-coeff 0``): the base's router is already
    trained, and a balancing loss would pull its choices away from the ones vLLM samples with.
    Megatron-LM and Megatron-Bridge use Qwen3's pre-training value, 1e-3 (HF
    ``router_aux_loss_coef``), for supervised fine-tuning."""

    aux_loss_coeff: float = 0.0
    """Load-balancing (switch) auxiliary loss coefficient; 0: none."""
    z_loss_coeff: float = 0.0
    """Router z-loss coefficient (ST-MoE); 0: none."""
    token_dispatcher: str = "auto"
    """auto (alltoall under NCCL, allgather otherwise: Megatron's alltoall dispatcher needs CUDA
    streams), allgather or alltoall."""
    grouped_gemm: bool = True
    """With Transformer Engine, run each rank's experts as one grouped GEMM (TEGroupedMLP); the
    local spec always runs them one after another (SequentialMLP)."""

    def __post_init__(self) -> None:
        if self.aux_loss_coeff < 0 or self.z_loss_coeff < 0:
            raise ValueError("model.moe.aux_loss_coeff and model.moe.z_loss_coeff must be >= 0.")
        check_choice("model.moe.token_dispatcher", self.token_dispatcher, TokenDispatcher)


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to build and with which kernels."""

    hf_path: Optional[str] = None
    """Hugging Face model directory whose config.json defines the architecture. Null: use ``arch``."""
    arch: ModelArch = field(default_factory=ModelArch)
    """Inline architecture, used when hf_path is null (the tiny CPU preset)."""
    transformer_impl: str = "auto"
    """auto (transformer_engine with CUDA and TE installed, local otherwise), local or transformer_engine."""
    precision: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU), fp32 or bf16."""
    fp8: Optional[str] = None
    """null, hybrid or e4m3: FP8 GEMMs through Transformer Engine (GPU only)."""
    fp8_recipe: str = "delayed"
    """delayed, tensorwise, blockwise or mxfp8 (TE scaling recipe; mxfp8 needs Blackwell)."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times tp; padded logits are masked in the loss."""
    fp32_lm_head: bool = False
    """Compute the output projection (logits) in fp32 from the bf16 weights, as the rollout engine
    can; keeps train/inference log-prob drift down in bf16 runs. A no-op in fp32."""
    recompute: Optional[str] = None
    """Activation recomputation: null, selective or full (full recomputes every layer)."""
    init_std: float = 0.02
    """Std of the random init (weights are normally loaded from a checkpoint)."""
    dropout: float = 0.0
    """Hidden and attention dropout probability during training steps (0: the recipe trains without).
    Non-zero makes each step draw from the RNG, whose state checkpoints save and restore."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Router losses and expert kernels of a mixture-of-experts model."""

    def __post_init__(self) -> None:
        if self.transformer_impl not in ("auto", "local", "transformer_engine"):
            raise ValueError(f"model.transformer_impl must be auto, local or transformer_engine, "
                             f"got {self.transformer_impl!r}.")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"model.precision must be auto, fp32 or bf16, got {self.precision!r}.")
        check_choice("model.fp8", self.fp8, Fp8Format, allow_none=True)
        check_choice("model.fp8_recipe", self.fp8_recipe, Fp8Recipe)
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"model.recompute must be null, selective or full, got {self.recompute!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}.")

    def resolve_arch(self) -> ModelArch:
        return ModelArch.from_hf_dir(self.hf_path) if self.hf_path else self.arch


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (Apriel configs: 5e-7; GSPO script and PipelineRL default: 1e-6)."""
    min_lr: float = 0.0
    warmup_steps: int = 50
    """Linear warm-up from 0 to lr over this many optimizer steps."""
    decay_style: str = "cosine"
    """cosine, linear or constant after warm-up."""
    decay_steps: Optional[int] = None
    """Steps over which the LR decays to min_lr; null = the run's trainer.steps."""
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 0.1
    """Global gradient-norm clip (Apriel: 0.1; PipelineRL default 0.3)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron distributed optimizer)."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim needs 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}.")
        if self.decay_style not in ("cosine", "linear", "constant"):
            raise ValueError(f"optim.decay_style must be cosine, linear or constant, got {self.decay_style!r}.")
        if self.warmup_steps < 0 or self.clip_grad < 0:
            raise ValueError("optim.warmup_steps and optim.clip_grad must be >= 0.")
