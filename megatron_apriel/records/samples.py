"""The trainer's view of a rollout: `TrainSample` (one trajectory as the batcher packs it), the
routed-experts rows it replays (`routing_rows`), and the split of samples over ranks by tokens
(`balance_by_tokens`). Built from the stream's records by `RolloutGroup.train_sample`
(``records/rollouts.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


def routing_rows(ids_TLK: np.ndarray, moe_layers: Sequence[int]) -> np.ndarray:
    """vLLM's ``[tokens - 1, num_hidden_layers, k]`` routed experts -> the trainer's ``[tokens,
    len(moe_layers), k]`` int16: the sparse layers only, and a ``-1`` row for the last token (never
    routed: the trainer's router picks for it, and nothing is scored at that position)."""
    rows = ids_TLK[:, list(moe_layers)].astype(np.int16)
    return np.concatenate([rows, np.full((1, *rows.shape[1:]), -1, dtype=np.int16)])


@dataclass
class TrainSample:
    """One trajectory as the trainer's batcher sees it: every token goes through the forward pass,
    the model's completion tokens (``mask``) carry the loss."""

    tokens: np.ndarray
    """Prompt followed by completion token ids (1-D integer array; a list is converted)."""
    prompt_len: int
    behaviour_logprobs: np.ndarray
    """Log-prob of each model token under the policy that sampled it (len = model tokens; float32
    array; a list is converted)."""
    advantage: float
    truncated: bool = False
    """The trajectory hit a length, turn or token limit (overlong filtering masks it out of the loss)."""
    fresh_start: int = 0
    """Model tokens from this index on (counted over model tokens) were sampled by the very weights
    being trained: on them |log pi_train - log pi_behaviour| is pure train/inference drift (read
    only where ``lags`` is not given)."""
    group: int = -1
    """The sequence number of its group in the stream (for error messages; -1: not from a stream)."""
    lags: Optional[np.ndarray] = None
    """Per model token, how many weight versions older than the trained ones sampled it (0: fresh;
    int32 array, a list is converted); None: 0 from ``fresh_start`` on, 1 before."""
    server: str = ""
    """The URL of the server that generated it ("": not from a fleet)."""
    routing: Optional[np.ndarray] = None
    """MoE models: the experts vLLM routed each token to, ``[len(tokens), moe_layers, top_k]``
    integers, -1 where it did not route the token (the last sampled one); None: not recorded."""
    mask: Optional[np.ndarray] = None
    """Per completion token, True where the model sampled it (bool array, a list is converted);
    False on the environment's tokens (tool results, user turns, template), which are context
    only. None: every completion token is the model's (single turn)."""
    stale_cache: Optional[np.ndarray] = None
    """Per model token, True where it was sampled over KV computed by older weights than those
    that sampled it (``fleet.kv_on_update=keep``; ``Rollout.stale_cache``): such a token is never
    counted fresh. None: none was."""

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens)
        self.behaviour_logprobs = np.asarray(self.behaviour_logprobs, dtype=np.float32)
        if self.routing is not None and (self.routing.ndim != 3 or len(self.routing) != len(self.tokens)):
            raise ValueError(f"sample routing must be [tokens={len(self.tokens)}, moe_layers, top_k], got "
                             f"{self.routing.shape}.")
        n_completion = len(self.tokens) - self.prompt_len
        if self.prompt_len < 1 or n_completion < 0:
            raise ValueError(f"sample needs 1 <= prompt_len <= len(tokens), got {self.prompt_len} and "
                             f"{len(self.tokens)}.")
        if self.mask is not None:
            self.mask = np.asarray(self.mask, dtype=bool)
            if self.mask.shape != (n_completion,):
                raise ValueError(f"sample mask must have one entry per completion token ({n_completion}), got "
                                 f"shape {self.mask.shape}.")
        n_model = self.model_length
        if self.lags is None:
            self.lags = (np.arange(n_model) < self.fresh_start).astype(np.int32)
        self.lags = np.asarray(self.lags, dtype=np.int32)
        if len(self.lags) != n_model:
            raise ValueError(f"sample has {n_model} model tokens but {len(self.lags)} lags.")
        if self.stale_cache is not None:
            self.stale_cache = np.asarray(self.stale_cache, dtype=bool)
            if self.stale_cache.shape != (n_model,):
                raise ValueError(f"sample has {n_model} model tokens but a stale_cache of shape "
                                 f"{self.stale_cache.shape}.")
        if len(self.behaviour_logprobs) != n_model:
            raise ValueError(
                f"sample has {n_model} model tokens but {len(self.behaviour_logprobs)} behaviour log-probs."
            )

    @property
    def model_length(self) -> int:
        """The completion tokens the model sampled (those with a loss)."""
        return len(self.tokens) - self.prompt_len if self.mask is None else int(self.mask.sum())

    def completion_mask(self) -> np.ndarray:
        """``mask``, all True where it is None."""
        return np.ones(len(self.tokens) - self.prompt_len, dtype=bool) if self.mask is None else self.mask


def balance_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices split into ``parts`` lists of similar total length (greedy, longest first,
    deterministic); each list is sorted."""
    load = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(parts), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        out[r].append(i)
    return [sorted(o) for o in out]
