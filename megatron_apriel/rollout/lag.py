"""Policy lag: how stale a group may be, and the actor's admission rule that keeps it so.

Versions count optimizer steps: the weights after k steps are version k, and step k trains
version k. A group whose oldest token was sampled by version v and that is trained at step k has
lag ``k - v``; ``max_lag`` bounds it (0: synchronous, on-policy RL).

The actor cannot know when a group will be trained, only an upper bound: the trainer reads
``groups_per_step`` usable groups per step in stream order, so the group that is ``p``-th in line
(groups written but not yet read, plus groups in flight) will be trained no later than step
``step + (filled + p) // groups_per_step`` (groups dropped by filters only make it earlier). It
will be sampled by weights no older than the version the trainer has published. Admitting it
only if that bound minus that version is at most ``max_lag`` therefore keeps every group within
the bound, and stops the actor at the bound while the trainer is down.
"""

from __future__ import annotations

from typing import Optional

from megatron_apriel.rollout.stream import TrainerProgress


def predicted_step(progress: TrainerProgress, position: int, groups_per_step: int) -> int:
    """Latest step at which the group ``position``-th in line (0-based) can be trained."""
    return progress.step + (progress.filled + position) // groups_per_step


def may_admit(progress: TrainerProgress, queued: int, groups_per_step: int, max_lag: Optional[int],
              max_queued: int) -> bool:
    """Whether one more group may be started when ``queued`` groups are ahead of it (written but
    not read by the trainer, or in flight). ``max_lag=None`` puts no bound on the lag (the recipe's
    setting); ``max_queued`` always caps the queue, so a stopped trainer never lets the stream grow
    without end."""
    if queued >= max_queued:
        return False
    if max_lag is None:
        return True
    return predicted_step(progress, queued, groups_per_step) - progress.version <= max_lag


def group_lag(step: int, min_version: int) -> int:
    return step - min_version
