"""A rollout source that samples from the trainer's own Megatron model (no vLLM).

It exists so that the trainer can be run and tested end to end on one CPU before the actor and
the vLLM fleet are attached: prompts are random token strings, each gets a group of G sampled
completions of fixed length, and the reward is a verifiable toy rule (the share of completion
tokens in the lower half of the vocabulary), so a working optimizer visibly raises it. Behaviour
log-probs are recorded at sampling time exactly as vLLM reports them (temperature-scaled), so
the first GSPO ratio of every step is 1 up to float round-off: a live train/inference drift check.

Each data-parallel rank samples its own share of the prompts; TP ranks sample identical tokens
(same generator seed, gathered logits). Pipeline parallelism is not supported here.
"""

from __future__ import annotations

import torch

from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.parallel.collectives import all_gather_cat, all_reduce_sum
from megatron_apriel.parallel.groups import ParallelContext
from megatron_apriel.records.config import RolloutConfig
from megatron_apriel.records.samples import TrainSample
from megatron_apriel.rewards import RewardConfig, group_advantages, is_zero_advantage_group


def lower_half_reward(completion: list[int], vocab_size: int) -> float:
    return sum(t < vocab_size // 2 for t in completion) / max(len(completion), 1)


class LocalRolloutSource:
    """``rollout.groups_per_step`` prompts of ``rollout.local.prompt_len`` random tokens per step,
    each with ``group_size`` completions of ``sampling.max_tokens`` tokens (the run's sampling
    settings: ``RunConfig.sampling``)."""

    def __init__(self, *, cfg: RolloutConfig, model, ctx: ParallelContext, vocab_size: int, sampling: SamplingConfig,
                 rewards: RewardConfig):
        if ctx.dims.pp > 1:
            raise ValueError("rollout.source=local samples with the trainer model and needs parallel.pp=1.")
        if ctx.dims.cp > 1:
            raise ValueError("rollout.source=local generates with the trainer's own model, which context parallelism "
                             "splits: use rollout.source=fleet (or replay) with parallel.cp > 1.")
        if cfg.groups_per_step < ctx.dims.dp:
            raise ValueError(f"rollout.groups_per_step={cfg.groups_per_step} < dp={ctx.dims.dp}: every "
                             "data-parallel rank needs at least one prompt.")
        if ctx.sequence_parallel:
            raise ValueError("rollout.source=local samples token by token, which sequence parallelism cannot split: "
                             "set parallel.sequence_parallel=false.")
        if ctx.dims.ep > 1 and cfg.groups_per_step % ctx.dims.dp:
            raise ValueError(f"with parallel.ep={ctx.dims.ep} every data-parallel rank runs the same number of "
                             f"forwards (they exchange tokens): set rollout.groups_per_step to a multiple of "
                             f"dp={ctx.dims.dp}.")
        self.cfg, self.model, self.ctx = cfg, model, ctx
        self.vocab_size, self.sampling = vocab_size, sampling
        self.rewards = rewards

    def _generator(self, step: int, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(hash((self.cfg.local.seed, step, index)) % (2**63))

    def _next_token_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        logits = self.model(tokens, positions, None)[:, -1, :].float()  # [G, V/tp]
        if self.ctx.dims.tp > 1:
            logits = all_gather_cat(logits, self.ctx.pgs.tp)
        return logits[:, : self.vocab_size].cpu()

    @torch.no_grad()
    def sample_group(self, prompt: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``G`` completions of one prompt: tokens ``[G, P + T]`` and behaviour log-probs ``[G, T]``."""
        tokens = torch.tensor(prompt).repeat(self.cfg.group_size, 1)
        logps = []
        for _ in range(self.sampling.max_tokens):
            logp_all = torch.log_softmax(
                self._next_token_logits(tokens.to(self.ctx.device)) / self.sampling.temperature, -1)
            nxt = torch.multinomial(logp_all.exp(), 1, generator=gen)  # [G, 1]
            logps.append(logp_all.gather(-1, nxt))
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens, torch.cat(logps, dim=1)

    def state_dict(self) -> dict:
        """Nothing to save: a step's prompts and samples derive from (seed, step, prompt index)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"the local rollout source keeps no state, got {sorted(state)}.")

    def weights_updated(self, version: int) -> None:
        """Nothing to do: it samples from the trainer's own weights."""

    def next_batch(self, step: int, idle=None) -> tuple[list[TrainSample], dict[str, float]]:
        """This DP rank's samples for ``step`` and the step's rollout metrics (over all ranks)."""
        was_training = self.model.training
        self.model.eval()
        samples, rewards, kept = [], [], 0
        for index in range(self.ctx.dp_rank, self.cfg.groups_per_step, self.ctx.dims.dp):
            gen = self._generator(step, index)
            prompt = torch.randint(0, self.vocab_size, (self.cfg.local.prompt_len,), generator=gen).tolist()
            tokens, logps = self.sample_group(prompt, gen)
            group_rewards = [lower_half_reward(t[len(prompt):].tolist(), self.vocab_size) for t in tokens]
            rewards += group_rewards
            adv = group_advantages(group_rewards, mode=self.rewards.advantage_mode, eps=self.rewards.advantage_eps)
            if self.rewards.filter_zero_advantage_groups and \
                    is_zero_advantage_group(adv, self.rewards.zero_advantage_tol):
                continue
            kept += 1
            samples += [TrainSample(t.tolist(), len(prompt), lp.tolist(), float(a), group=index)
                        for t, lp, a in zip(tokens, logps, adv)]
        self.model.train(was_training)
        totals = torch.tensor([sum(rewards), len(rewards), kept], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.dims.dp > 1:
            all_reduce_sum(totals, self.ctx.pgs.dp)
        groups = totals[1].item() / self.cfg.group_size
        return samples, {"rollout/reward": totals[0].item() / totals[1].item(),
                         "rollout/groups_filtered": groups - totals[2].item()}
