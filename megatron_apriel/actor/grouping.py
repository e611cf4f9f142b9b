"""One finished group of G completions -> its rollout record (pure; the actor calls it once the
group is generated and verified):

1. task reward per completion: the verifier's score, 0 when the completion was truncated;
2. success: solved and not truncated;
3. shaped reward: the length penalty on the tokens over ``max_len - buffer``, difficulty-aware
   (scaled by the group's solve rate) when DAP is on (``rewards.shape_group_rewards``);
4. advantages over the group (leave-one-out by default);
5. the drop rule: a verifier failure drops the group (no training on a verdict nobody knows); so
   does a group whose advantages are all ~0 (dynamic sampling), when that filter is on;
6. the record, with each verifier note kept (``DETAIL_CHARS``) and, from a server that returns
   them, the experts each token was routed to (for rollout routing replay).
"""

from __future__ import annotations

from megatron_apriel.fleet.client import Completion
from megatron_apriel.records.rollouts import DETAIL_CHARS, GroupTimings, Outcome, Problem, Rollout, RolloutGroup
from megatron_apriel.rewards import (
    RewardConfig,
    group_advantages,
    is_zero_advantage_group,
    shape_group_rewards,
    task_reward,
)


def build_group(*, problem: Problem, prompt_ids: list[int], completions: list[Completion], results: list,
                rewards: RewardConfig, admitted_version: int, timings: GroupTimings) -> RolloutGroup:
    """The record of one finished, verified group (pure); the steps are the module's."""
    truncated = [c.finish_reason == "length" for c in completions]
    scores = [task_reward(r.score, t) for r, t in zip(results, truncated)]
    success = [r.success and not t for r, t in zip(results, truncated)]
    lengths = [len(c.token_ids) for c in completions]
    shaped = shape_group_rewards(rewards, scores, lengths, success, truncated)
    adv = group_advantages(shaped, mode=rewards.advantage_mode, eps=rewards.advantage_eps)
    dropped = None
    if any(r.outcome is Outcome.VERIFIER_ERROR for r in results):
        dropped = "verifier_error"
    elif rewards.filter_zero_advantage_groups and is_zero_advantage_group(adv, rewards.zero_advantage_tol):
        dropped = "zero_advantage"
    rollouts = [Rollout(completion_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions,
                        finish_reason=c.finish_reason, outcome=r.outcome, detail=r.detail[:DETAIL_CHARS],
                        score=r.score, success=ok,
                        reward=float(sh), advantage=float(a), server=c.server, attempts=c.attempts,
                        routed_experts=c.routed_experts)
                for c, r, ok, sh, a in zip(completions, results, success, shaped, adv)]
    return RolloutGroup(seq=-1, problem_id=problem.id, domain=problem.domain, prompt_ids=prompt_ids,
                        rollouts=rollouts, admitted_version=admitted_version, dropped=dropped, timings=timings)
