"""One finished group of G trajectories -> its rollout record (pure; the actor calls it once the
group's episodes are scored):

1. task reward per trajectory: the environment's score, 0 when the trajectory was truncated (its
   last turn hit the length limit, or the actor stopped it at ``actor.max_turns`` or the token
   budget);
2. success: solved and not truncated;
3. shaped reward: the length penalty on the model's tokens over ``max_len - buffer`` (the
   environment's tokens are not the model's verbosity), difficulty-aware
   (scaled by the group's solve rate) when DAP is on (``rewards.shape_group_rewards``);
4. advantages over the group (leave-one-out by default);
5. the drop rule: a verifier failure drops the group (no training on a verdict nobody knows); so
   does a group whose advantages are all ~0 (dynamic sampling), when that filter is on;
6. the record, with each verifier note kept (``DETAIL_CHARS``) and, from a server that returns
   them, the experts each token was routed to (for rollout routing replay).
"""

from __future__ import annotations

from typing import Sequence, Union

from megatron_apriel.actor.trajectory import Trajectory
from megatron_apriel.fleet.client import Completion
from megatron_apriel.records.rollouts import DETAIL_CHARS, GroupTimings, Outcome, Problem, Rollout, RolloutGroup
from megatron_apriel.rewards import (
    RewardConfig,
    group_advantages,
    is_zero_advantage_group,
    shape_group_rewards,
    task_reward,
)


def build_group(*, problem: Problem, prompt_ids: list[int], completions: Sequence[Union[Trajectory, Completion]],
                results: list, rewards: RewardConfig, admitted_version: int, timings: GroupTimings) -> RolloutGroup:
    """The record of one finished, scored group (pure); the steps are the module's. A
    ``Completion`` is the one-turn trajectory of its tokens."""
    completions = [c if isinstance(c, Trajectory) else Trajectory.single(c, len(prompt_ids)) for c in completions]
    truncated = [c.truncated for c in completions]
    scores = [task_reward(r.score, t) for r, t in zip(results, truncated)]
    success = [r.success and not t for r, t in zip(results, truncated)]
    lengths = [c.model_length for c in completions]
    shaped = shape_group_rewards(rewards, scores, lengths, success, truncated)
    adv = group_advantages(shaped, mode=rewards.advantage_mode, eps=rewards.advantage_eps)
    dropped = None
    if any(r.outcome is Outcome.VERIFIER_ERROR for r in results):
        dropped = "verifier_error"
    elif rewards.filter_zero_advantage_groups and is_zero_advantage_group(adv, rewards.zero_advantage_tol):
        dropped = "zero_advantage"
    rollouts = [Rollout(completion_ids=c.ids, logprobs=c.logprobs, versions=c.versions, model_turns=c.turns,
                        finish_reason=c.finish_reason, truncated=c.truncated, outcome=r.outcome,
                        detail=r.detail[:DETAIL_CHARS], score=r.score, success=ok,
                        reward=float(sh), advantage=float(a), server=c.server, attempts=c.attempts,
                        routed_experts=c.routed_experts(), context_versions=c.context_versions)
                for c, r, ok, sh, a in zip(completions, results, success, shaped, adv)]
    return RolloutGroup(seq=-1, problem_id=problem.id, domain=problem.domain, prompt_ids=prompt_ids,
                        rollouts=rollouts, admitted_version=admitted_version, dropped=dropped, timings=timings)
