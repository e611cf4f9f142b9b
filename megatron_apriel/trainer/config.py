"""Settings of the trainer process: steps and packing (``trainer.*``), the policy loss
(``loss.*``) and checkpoints (``checkpoint.*``). A leaf: standard library only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_apriel.choices import Correction, CorrectionAnchor, CorrectionCount, LossKind, check_choice, choices

LOGPROB_CHUNK_TOKENS = 2048
"""Default of ``trainer.logprob_chunk_tokens``: at Apriel's 131K vocabulary, ~1 GiB per fp32
``[chunk, V]`` tensor at TP1 (a few coexist), against ~25 GiB of full logits at 20K tokens."""


@dataclass(kw_only=True)
class TrainerConfig:
    steps: int = 250
    """Optimizer steps in the run (the paper: 250)."""
    seq_len: int = 20480
    """Longest prompt + completion in tokens; also the packed row length (16K output + prompt)."""
    packing: bool = True
    """Pack several sequences per row (THD). False: right-padded rows of micro_batch_size."""
    micro_batch_size: int = 1
    """Rows per micro-batch when packing is off."""
    log_every: int = 1
    logprob_chunk_tokens: int = LOGPROB_CHUNK_TOKENS
    """Log-probs from the last hidden states of the loss positions only, this many tokens of logits at a
    time, recomputed in backward: extra memory O(chunk x V/tp) whatever the sequence length.
    0: the full logits of every position, as the output layer makes them (kept for comparison)."""

    def __post_init__(self) -> None:
        if min(self.steps, self.seq_len, self.micro_batch_size, self.log_every) < 1:
            raise ValueError("trainer.steps, seq_len, micro_batch_size and log_every must be >= 1.")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(f"trainer.logprob_chunk_tokens must be >= 0 (0: full logits), got "
                             f"{self.logprob_chunk_tokens}.")


LOSS_KINDS = choices(LossKind)


@dataclass(kw_only=True)
class LossConfig:
    kind: str = "gspo"
    """gspo (sequence ratio), gspo_token (GSPO-token: same value and gradient, per-token form) or
    grpo (token ratio; with aggregation=token_mean this is DAPO's token-level loss)."""
    eps_low: float = 3e-3
    """Lower clip: ratios below 1 - eps_low stop pushing down. GSPO paper: 3e-4; authors' runs: 3e-3."""
    eps_high: float = 4e-3
    """Upper clip: ratios above 1 + eps_high stop pushing up. GSPO paper: 4e-4; DAPO (grpo): 0.28."""
    seq_weighting: str = "length"
    """gspo/gspo_token: length (w_i = n_i, the authors' choice, complements DAP) or equal (w_i = 1)."""
    aggregation: str = "token_mean"
    """grpo only: token_mean (DAPO: sum over tokens / tokens in step) or seq_mean_token_mean (GRPO)."""
    overlong_filtering: bool = True
    """Truncated sequences get no loss (they still count in the normaliser B)."""
    temperature: float = 1.0
    """Sampling temperature: logits are divided by it before the log-softmax (as vLLM does)."""
    correction: str = "none"
    """Train/inference mismatch correction (docs/mismatch.md; RECIPE.md section 10), with
    rho_t = pi_train(y_t) / pi_vllm(y_t) from the weights that start the step and g_i =
    exp(mean_t log rho_t), a sequence's geometric mean:
    none (the recipe: the ratio is taken against vLLM's log-probs, no weight);
    token_tis (each token weighted by min(rho_t, correction_clip));
    seq_tis (each sequence by min(g_i, correction_seq_high), GSPO's geometric form);
    seq_is (each sequence by min(prod_t rho_t, correction_seq_clip): verl's rollout_is=sequence);
    token_mask (tokens with rho_t outside [correction_low, correction_high] carry no loss, the others
    weight rho_t: masked IS / IcePop);
    seq_mask (sequences with g_i outside [correction_seq_low, correction_seq_high] carry no loss, the
    others token_tis). ``correction_anchor`` says what the policy ratio is taken against."""
    correction_anchor: str = "behaviour"
    """With a correction: behaviour (the ratio stays pi / mu, so the recipe's clip keeps its trust
    region, and the correction acts on top: the step's gradient is the current form's wherever the
    clip does not bind, and 0 where it binds; verl's bypass mode with rejection) or current (the ratio is
    pi / sg[pi], 1 in value: the clip never binds and the step is the policy gradient weighted by the
    correction, capped only by C; refused with rollout.max_lag=null). Ignored with correction=none."""
    correction_clip: float = 2.0
    """C of the token-level TIS: token_tis and seq_mask's kept sequences (slime, verl and SkyRL use 2)."""
    correction_low: float = 0.5
    """Lower bound on rho_t of token_mask (IcePop: 0.5)."""
    correction_high: float = 2.0
    """Upper bound on rho_t of token_mask (IcePop: 2)."""
    correction_seq_low: float = 0.99
    """Lower bound on g_i of seq_mask (SkyRL's geometric mask: 0.99)."""
    correction_seq_high: float = 1.01
    """Upper bound on g_i of seq_mask, and the cap of seq_tis's weight (SkyRL: 1.01; verl's geometric
    threshold: 1.0002-1.001). A geometric mean moves little: 2 would take a mean |log rho| of 0.69 nats."""
    correction_seq_clip: float = 2.0
    """C of seq_is, on the product of a sequence's rho_t (verl's rollout_is_threshold: 2)."""
    correction_count: str = "all"
    """What the step's count (and each sequence's token mean) includes when a mask drops tokens or
    sequences (token_mask, seq_mask): all (the masked ones still count, so the step shrinks as the cut
    share grows) or kept (verl: they leave the denominators). The truncating corrections drop nothing."""

    def __post_init__(self) -> None:
        check_choice("loss.kind", self.kind, LossKind)
        self._check_correction()
        if not (0 <= self.eps_low < 1) or self.eps_high < 0:
            raise ValueError(f"loss.eps_low must be in [0, 1) and loss.eps_high >= 0, "
                             f"got {self.eps_low}, {self.eps_high}.")
        if self.seq_weighting not in ("length", "equal"):
            raise ValueError(f"loss.seq_weighting must be length or equal, got {self.seq_weighting!r}.")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean"):
            raise ValueError(f"loss.aggregation must be token_mean or seq_mean_token_mean, got {self.aggregation!r}.")
        if self.temperature <= 0:
            raise ValueError(f"loss.temperature must be > 0, got {self.temperature}.")

    def _check_correction(self) -> None:
        check_choice("loss.correction", self.correction, Correction)
        check_choice("loss.correction_anchor", self.correction_anchor, CorrectionAnchor)
        check_choice("loss.correction_count", self.correction_count, CorrectionCount)
        if self.correction_clip <= 0 or self.correction_seq_clip <= 0:
            raise ValueError(f"loss.correction_clip and loss.correction_seq_clip must be > 0, got "
                             f"{self.correction_clip}, {self.correction_seq_clip}.")
        for level in ("", "seq_"):
            low, high = getattr(self, f"correction_{level}low"), getattr(self, f"correction_{level}high")
            if not 0 <= low <= 1 <= high:
                raise ValueError(f"loss.correction_{level}low must be in [0, 1] and loss.correction_{level}high >= "
                                 f"1, got {low}, {high}.")
        if self.correction == "none" and self.correction_anchor == "current":
            raise ValueError("loss.correction_anchor=current takes the ratio against the step's own weights, which "
                             "only a correction weighs: with loss.correction=none (the recipe, ratio against vLLM's "
                             "log-probs) set loss.correction_anchor=behaviour, or choose a loss.correction.")


@dataclass(kw_only=True)
class CheckpointConfig:
    save_every: int = 50
    """Save every this many optimizer steps (0: only at the end and on SIGTERM/SIGUSR1)."""
    save_at_end: bool = True
    resume: bool = True
    """Continue from the newest complete checkpoint in run_dir/checkpoints when there is one."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a successful save (0: keep all)."""
    load: Optional[str] = None
    """Initial model weights for a fresh run: a Megatron dist checkpoint (apriel-convert hf-to-mcore)."""

    def __post_init__(self) -> None:
        if self.save_every < 0 or self.keep_last < 0:
            raise ValueError("checkpoint.save_every and checkpoint.keep_last must be >= 0.")
