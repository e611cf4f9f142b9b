"""Multi-turn rollouts in the actor, token in and token out, against a fake fleet with the tiny
model's real BPE tokenizer and chat template (``FakeToolFleet``: the fake model writes tool calls
and answers; its ids are its text encoded in random pieces, as a sampler's often are): the
record's ids are the prompt, each turn's ids as sampled, and each reply's template ids between
them; the mask, per-model-token log-probs, versions and routes; the turn and token limits; a tool
that hangs, answered with an error while the actor's event loop runs on."""

import asyncio
import functools
import json
import time

import numpy as np
import pytest

from megatron_apriel.actor.config import ActorConfig
from megatron_apriel.actor.episodes import EpisodeWorkers, InlineEpisodes
from megatron_apriel.actor.loop import Actor
from megatron_apriel.actor.trajectory import PROBE, ChatTokens
from megatron_apriel.data.datasets import ProblemPools
from megatron_apriel.data.order import DomainOrder
from megatron_apriel.envs.arithmetic import SYSTEM, TOOLS
from megatron_apriel.envs.config import EnvsConfig, ToolCallConfig
from megatron_apriel.envs.registry import build_environments
from megatron_apriel.fleet.client import FleetClient
from megatron_apriel.fleet.config import SamplingConfig
from megatron_apriel.records.config import RolloutConfig
from megatron_apriel.records.rollouts import Outcome, Problem
from megatron_apriel.records.stream import StreamReader, StreamWriter, TrainerProgress, write_progress
from megatron_apriel.rewards import RewardConfig
from megatron_apriel.sampling.domain_sampler import SamplerConfig
from megatron_apriel.testing.fake_envs import hanging_environments
from megatron_apriel.testing.fake_fleet import TOOL_RESULT, FakeToolFleet, calculator_policy
from megatron_apriel.tiny.model import TinySpec, build_tokenizer

sum_policy = calculator_policy
_RESULT = TOOL_RESULT


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TinySpec(training_files=8))


def sum_problems(n: int) -> list[Problem]:
    return [Problem(id=f"sum3-{i}", domain="math", prompt=[{"role": "user", "content": f"What is {i} + {2 * i + 1} + "
                                                            f"{i * i}? Use the calculator."}],
                    reference={"answer": i + 2 * i + 1 + i * i}, metadata={"environment": "arithmetic"})
            for i in range(n)]


def loop_policy(context: str) -> str:
    return "[add(a=1, b=1)]"


def make_actor(root, fleet, tokenizer, episodes=None, group_size=4, **cfg):
    cfg = ActorConfig(sampler=SamplerConfig(weights={"math": 1.0}), max_in_flight=4, flush_interval_s=0.01,
                      poll_s=0.005, **cfg)
    if episodes is None:  # trusted tools: run inline, without forks, in the test's process
        episodes = InlineEpisodes(build_environments(EnvsConfig(calls=ToolCallConfig(isolate=False))))
    return Actor(cfg=cfg, rollout=RolloutConfig(group_size=group_size, groups_per_step=8, max_lag=None),
                 rewards=RewardConfig(max_len=64, buffer=16), sampling=SamplingConfig(max_tokens=64),
                 client=FleetClient(["http://fake-a", "http://fake-b"], transport=fleet.transport()),
                 sampler=cfg.sampler.build(), order=DomainOrder(ProblemPools(sum_problems(12)), seed=0),
                 tokenizer=tokenizer, stream=StreamWriter(root), episodes=episodes)


async def _groups(root, actor, n, during=None):
    write_progress(root, TrainerProgress(step=0, filled=0, cursor=0, version=0))
    stop = asyncio.Event()
    task = asyncio.create_task(actor.run(stop))
    watch = asyncio.create_task(during()) if during else None
    while actor.stream.next_seq < n:
        await asyncio.sleep(0.005)
    stop.set()
    await task
    await actor.client.aclose()
    if watch:
        watch.cancel()
    return StreamReader(root).read_all()[:n]


def run_groups(root, actor, n, during=None):
    return asyncio.run(_groups(root, actor, n, during))


def conversation(tokenizer, group, rollout):
    """The trajectory's messages: the arithmetic episode's first ones, then each model turn's
    decoded text and the tool results the fake model read (re-derived from the ids)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(tokenizer, group)}]
    ids = np.concatenate([group.prompt_ids, rollout.completion_ids]).tolist()
    p = len(group.prompt_ids)
    for k, turn in enumerate(rollout.model_turns):
        messages.append({"role": "assistant",
                         "content": tokenizer.decode(ids[p + turn.start:p + turn.end], skip_special_tokens=True)})
        if k + 1 < len(rollout.model_turns):
            env = tokenizer.decode(ids[p + turn.end:p + rollout.model_turns[k + 1].start], skip_special_tokens=False)
            messages += [{"role": "tool", "content": r} for r in _RESULT.findall(env)]
    return messages


def _user(tokenizer, group):
    text = tokenizer.decode(group.prompt_ids.tolist(), skip_special_tokens=False)
    return text.split("<|user|>", 1)[1].split("<|eos|>", 1)[0]


def test_the_tiny_template_is_append_only_and_a_rewriting_one_is_reported(tokenizer):
    chat = ChatTokens(tokenizer)
    assert chat.append_only(PROBE) is None
    # the model stopped at its EOS: the template's close is the sampled token, nothing is added before the reply
    eos = [tokenizer.eos_token_id]
    assert chat.suffix_text(PROBE[:2], (), PROBE[3:4], eos) == "<|tool|>5<|eos|><|assistant|>"
    # a stop string stopped it (no EOS sampled): the close comes first
    assert chat.suffix_text(PROBE[:2], (), PROBE[3:4], [33]) == "<|eos|><|tool|>5<|eos|><|assistant|>"

    class Dropping:  # Qwen3-like: earlier assistant turns are rendered without their content
        def __init__(self, tok):
            self.tok = tok

        def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False, **kw):
            last = max(i for i, m in enumerate(messages) if m["role"] != "assistant")
            kept = [dict(m, content="") if m["role"] == "assistant" and i < last else m for i, m in enumerate(messages)]
            return self.tok.apply_chat_template(kept, add_generation_prompt=add_generation_prompt, tokenize=tokenize)

        def __getattr__(self, name):
            return getattr(self.tok, name)

    assert "not an append" in ChatTokens(Dropping(tokenizer)).append_only(PROBE)

    class EmptyThink(Dropping):  # writes an empty reasoning block into every assistant turn it renders, which
        def apply_chat_template(self, messages, **kw):  # the model never saw when it sampled
            return self.tok.apply_chat_template([dict(m, content="<think></think>" + m["content"])
                                                 if m["role"] == "assistant" else m for m in messages], **kw)

    assert "differ at character" in ChatTokens(EmptyThink(tokenizer)).append_only(PROBE)


@pytest.mark.parametrize("split_p", [0.3, 0.0])
def test_records_are_token_exact_and_text_retokenization_is_not(tmp_path, tokenizer, split_p):
    fleet = FakeToolFleet(tokenizer, sum_policy, split_p=split_p, seed=1, bump_every=5, routed_experts=(3, 2))
    actor = make_actor(tmp_path, fleet, tokenizer, max_trajectory_tokens=256)
    groups = run_groups(tmp_path, actor, 6)
    chat = ChatTokens(tokenizer)
    rollouts = retokenized_differ = spans_two = 0
    for g in groups:
        prompt = g.prompt_ids.tolist()
        assert prompt == chat.prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user(
            tokenizer, g)}], TOOLS)
        for r in g.rollouts:
            rollouts += 1
            ids = r.completion_ids.tolist()
            assert len(r.model_turns) == 3 and r.outcome is Outcome.CORRECT and r.success and not r.truncated
            messages = conversation(tokenizer, g, r)
            for k, turn in enumerate(r.model_turns):
                # token in: the request of turn k was the record's ids up to it, exactly;
                # token out: its ids are what the fleet sampled for that request
                assert ids[turn.start:turn.end] in fleet.sampled[tuple(prompt + ids[:turn.start])]
                if k:  # between two turns: the template's tokens for the tool message alone
                    at = 2 + 2 * (k - 1)  # system, user, then (assistant, tool) pairs: turn k-1 is messages[at]
                    last = ids[r.model_turns[k - 1].start:r.model_turns[k - 1].end]
                    env = ids[r.model_turns[k - 1].end:turn.start]
                    assert env == chat.between(messages[:at], TOOLS, messages[at + 1:at + 2], last)
            # the text of the ids is the whole conversation's render; its ids need not be the record's
            whole = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
            assert tokenizer.decode(prompt + ids[:r.model_turns[-1].start], skip_special_tokens=False) == whole
            full = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False,
                                                 return_dict=False)
            retokenized_differ += full != prompt + ids
            # per model token: the mask, the log-probs, the versions; routes for every position
            mask = r.mask
            assert mask.sum() == r.model_length == len(r.logprobs)
            np.testing.assert_allclose(r.logprobs, [-0.01 * (t % 7) for t in r.completion_ids[mask]], rtol=1e-6)
            assert r.versions[0].start == 0 and r.versions[-1].end == r.model_length
            assert all(a.end == b.start and a.version < b.version for a, b in zip(r.versions, r.versions[1:]))
            spans_two += len(r.versions) > 1
            routes = r.routed_experts.array()
            assert routes.shape == (len(prompt) + len(ids) - 1, 3, 2)
            assert all((routes[i] == FakeToolFleet.route(i, 3, 2)).all() for i in range(len(routes)))
            sample = g.train_sample(0, version=0)
            assert sample.mask is not None and sample.mask.sum() == g.rollouts[0].model_length
    print(f"\nsplit_p={split_p}: {rollouts} trajectories token-exact; re-rendering and re-tokenizing the text "
          f"gives other ids for {retokenized_differ} of {rollouts}; {spans_two} span two or more weight versions")
    assert spans_two > 0
    if split_p:
        assert retokenized_differ > rollouts // 2  # what a text round trip would have trained on instead
    else:
        assert retokenized_differ == 0  # canonical sampling: the template is append-only, the ids agree


def test_max_turns_stops_a_trajectory_truncated(tmp_path, tokenizer):
    fleet = FakeToolFleet(tokenizer, loop_policy, seed=2)
    groups = run_groups(tmp_path, make_actor(tmp_path, fleet, tokenizer, max_turns=3, max_trajectory_tokens=512), 2)
    for r in (r for g in groups for r in g.rollouts):
        assert len(r.model_turns) == 3 and r.truncated and r.finish_reason == "stop"
        assert r.outcome is Outcome.NO_ANSWER and r.score == 0 and not r.success
        assert r.model_turns[-1].end == r.length  # no environment tokens after the last turn


def test_the_token_budget_stops_a_trajectory_truncated(tmp_path, tokenizer):
    fleet = FakeToolFleet(tokenizer, sum_policy, split_p=0.0, seed=3)
    budget = 40  # the first turn fits, the second not entirely
    groups = run_groups(tmp_path, make_actor(tmp_path, fleet, tokenizer, max_trajectory_tokens=budget), 3)
    rollouts = [r for g in groups for r in g.rollouts]
    assert all(r.truncated and r.length <= budget and r.score == 0 for r in rollouts)
    cut = [r for r in rollouts if r.finish_reason == "length"]  # the last turn asked for what was left, and hit it
    assert cut and all(r.length == budget for r in cut)
    assert all(len(r.model_turns) >= 1 and r.model_turns[-1].end == r.length for r in rollouts)


def hang_policy(context: str) -> str:
    return "done" if "<|tool|>" in context else "[sleep(seconds=30), echo(text='hi')]"


def test_a_hanging_tool_is_answered_with_an_error_and_the_loop_runs_on(tmp_path, tokenizer):
    """Episodes in a real spawn worker, tool calls forked with a 0.5 s limit: the hung call is
    answered "timed out" (the next call of the same turn still runs), and the actor's event loop
    never stalls while the worker waits."""
    fleet = FakeToolFleet(tokenizer, hang_policy, split_p=0.0)
    workers = EpisodeWorkers(2, functools.partial(hanging_environments, 0.5))
    gaps = []

    async def ticker():
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    try:
        actor = make_actor(tmp_path, fleet, tokenizer, episodes=workers, group_size=2, environments={"math": "hang"},
                           max_trajectory_tokens=256)
        actor.order = DomainOrder(ProblemPools([Problem(id=f"h{i}", domain="math", prompt=[
            {"role": "user", "content": "Sleep."}], reference={}) for i in range(3)]), seed=0)
        t0 = time.monotonic()
        groups = run_groups(tmp_path, actor, 2, during=ticker)
        elapsed = time.monotonic() - t0
    finally:
        workers.shutdown()
    for r in (r for g in groups for r in g.rollouts):
        assert r.outcome is Outcome.CORRECT and "timed out after 0.5 s" in r.detail and len(r.model_turns) == 2
        env = tokenizer.decode(r.completion_ids[~r.mask].tolist(), skip_special_tokens=False)
        assert "timed out" in env and "<|tool|>hi<|eos|>" in env
    assert workers.live() == 0
    print(f"\n4 trajectories, each with a 0.5 s hung call, in {elapsed:.2f} s; the event loop's longest gap "
          f"{max(gaps) * 1000:.0f} ms over {len(gaps)} ticks")
    assert max(gaps) < 0.25


def test_the_environments_of_a_run_are_checked_with_a_fix(tmp_path):
    from megatron_apriel.config import compose_config, to_run_config
    from megatron_apriel.data.datasets import training_pools
    from megatron_apriel.entrypoints.actor import check_environments

    run = to_run_config(compose_config("smoke_multiturn", []))
    pools = training_pools(run.actor.data, run.actor.sampler.mix)
    check_environments(run, pools)  # the preset's: arithmetic and BFCL multi-turn rows, by their metadata
    assert {run.actor.environment(d, p.metadata) for d in pools.domains for p in pools.problems(d)} == {
        "arithmetic", "bfcl_multi_turn"}
    assert run.actor.environment("logic") == "logic"  # a domain left out is its verifier's single-turn one
    for override, error in [("actor.environments.math=calculator", "no such environment.*registered"),
                            ("+actor.environments.science=arithmetic", "unknown domain")]:
        with pytest.raises(ValueError, match=error):
            check_environments(to_run_config(compose_config("smoke_multiturn", [override])), pools)


def test_bfcl_multi_turn_rows_load_through_the_data_layer(tmp_path):
    pytest.importorskip("bfcl_eval")
    from megatron_apriel.data.sources import convert_rows
    from megatron_apriel.envs.bfcl_multi_turn import bfcl_data_dir

    data = bfcl_data_dir()
    answers = {json.loads(line)["id"]: json.loads(line)["ground_truth"] for line in
               (data / "possible_answer" / "BFCL_v4_multi_turn_base.json").read_text().splitlines() if line}
    problems, stats = convert_rows("bfcl_multi_turn", data / "BFCL_v4_multi_turn_base.json", answers=answers)
    assert len(problems) == 200 and not stats
    assert {p.metadata["environment"] for p in problems} == {"bfcl_multi_turn"}
