"""Policy lag: how stale a group may be, and the actor's admission rule that keeps it so.

Versions count optimizer steps: the weights after k steps are version k, and step k trains
version k. A group whose oldest token was sampled by version v and that is trained at step k has
lag ``k - v``; ``max_lag`` bounds it (0: synchronous, on-policy RL).

The actor cannot know when a group will be trained, only bound it. The trainer reads
``groups_per_step`` usable groups per step in stream order, and groups enter the stream in the
order they *finish*: a group written but not yet read keeps its place, but one still in flight can
be overtaken by every group admitted after it. So once a new group is admitted, each group in
flight (the new one included) may end up last in line, at position ``p`` = the written, unread
groups the trainer will train, plus all in flight; it is then trained no later than step
``step + (filled + p) // groups_per_step``. Each was sampled by weights no older than the version
published when it was admitted. The actor therefore admits a group only if that step minus the
oldest admitted version in flight (or the published version) is at most ``max_lag``. By
induction every group is trained within the bound; the actor stops at it while the trainer is
down. Groups the trainer will skip (dropped by the filters, known once written) are not counted
there; the backlog cap counts every group, so a stopped trainer stops the actor even when the
filters drop everything.
"""

from __future__ import annotations

from typing import Optional

from megatron_apriel.records.stream import TrainerProgress


def predicted_step(progress: TrainerProgress, position: int, groups_per_step: int) -> int:
    """Latest step at which the group ``position``-th in line (0-based) can be trained."""
    return progress.step + (progress.filled + position) // groups_per_step


def may_admit(progress: TrainerProgress, *, queued: int, groups_per_step: int, max_lag: Optional[int],
              max_queued: int, oldest_in_flight: Optional[int] = None, backlog: Optional[int] = None) -> bool:
    """Whether one more group may be started when ``queued`` groups are ahead of it (written and
    still to be trained, or in flight) and the oldest group in flight was admitted at version
    ``oldest_in_flight``. ``max_lag=None`` puts no bound on the lag (the recipe's setting).
    ``max_queued`` always caps the ``backlog`` (every group written and not yet read, dropped ones
    included, plus those in flight; ``queued`` if not given), so a stopped trainer never lets the
    stream grow without end."""
    if (queued if backlog is None else backlog) >= max_queued:
        return False
    if max_lag is None:
        return True
    oldest = progress.version if oldest_in_flight is None else min(progress.version, oldest_in_flight)
    return predicted_step(progress, queued, groups_per_step) - oldest <= max_lag


def group_lag(step: int, min_version: int) -> int:
    return step - min_version
