"""What the in-flight weight updates cost a trajectory's generation, read from its record (pure).

Under ``fleet.kv_on_update=recompute`` an update resets every running request: vLLM drops its KV
cache and prefills its prompt and every token sampled so far again, with the new weights. A new
version that starts inside a model turn marks such a reset. One that starts with a turn does not:
each turn is a request of its own, prefilled anyway. Under ``keep`` nothing is recomputed, and the
tokens sampled after an update attend over the older weights' cache instead (``stale_cache``).
vLLM's counters do not count the recomputed tokens (``weight_sync/engine_counters.py``).
"""

from __future__ import annotations

from megatron_apriel.records.rollouts import Rollout


def recomputed_tokens(prompt_len: int, rollout: Rollout) -> int:
    """Prefill tokens that updates made vLLM compute again for ``rollout``: for each version that
    starts inside a model turn, the turn's request up to that token (the prompt, the earlier turns
    and the environment's tokens, the turn's tokens before it). 0 for a rollout that recorded its
    context versions (``keep``: the cache was kept)."""
    if rollout.context_versions:
        return 0
    total = 0
    for span in rollout.versions[1:]:
        position = _completion_position(rollout, span.start)
        if position is not None:
            total += prompt_len + position
    return total


def stale_cache_tokens(rollout: Rollout) -> int:
    """Model tokens sampled over KV older than the weights that sampled them (``keep`` only)."""
    stale = rollout.stale_cache()
    return 0 if stale is None else int(stale.sum())


def _completion_position(rollout: Rollout, model_index: int) -> int | None:
    """The completion index of model token ``model_index``; None when it opens a model turn."""
    seen = 0
    for turn in rollout.model_turns:
        size = turn.end - turn.start
        if model_index < seen + size:
            offset = model_index - seen
            return None if offset == 0 else turn.start + offset
        seen += size
    raise ValueError(f"model token {model_index} is past the rollout's {seen} model tokens")
