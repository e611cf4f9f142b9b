"""`apriel-train --config-name smoke_5domains`: all five domains on the shipped example data, through
the real verifiers (code in the sandbox), the adaptive sampler, vLLM and the trainer, a few steps.

Math runs in the self-check environment (``envs/self_check.py``: the user asks for a check after
the first answer, the second is scored): multi-turn rollouts through real vLLM, token in and token
out, with the tiny model, which calls no tools. It runs under ``fleet.kv_on_update=keep``: every
request salted per weight version through real vLLM, the context versions recorded. The same launch
proves all three (no launch of its own)."""

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from megatron_apriel.records.rollouts import DOMAINS
from megatron_apriel.records.stream import StreamReader, StreamWriter
from megatron_apriel.sampling import DOMAIN_MIX_PAPER, AdaptiveDomainSampler
from tests.conftest import new_run_dir
from tests.unit.conftest import launcher_env

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
MULTI_TURN = ["+actor.environments={math: self_check}", "actor.max_trajectory_tokens=128"]
"""A trajectory's 128 tokens: a first answer (up to 64), the follow-up's template tokens, a second answer."""
KEEP = ["fleet.kv_on_update=keep"]
"""The non-default KV policy (the README run has the default): each request is salted with the
version the client knows the server serves (``cache_salt``), and the record keeps it per model turn."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_base):
    run = new_run_dir(tmp_path_factory.mktemp("smoke"), tiny_base)
    proc = subprocess.run([shutil.which("apriel-train"), "--config-name", "smoke_5domains", f"run_dir={run}",
                           *MULTI_TURN, *KEEP],
                          capture_output=True, text=True, timeout=1200, env=launcher_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return run


def groups(run):
    return StreamReader(run / "rollouts").read_all()


def test_every_domain_and_verifier_ran_without_verifier_errors(run_dir):
    stream = groups(run_dir)
    assert set(g.domain for g in stream) == set(DOMAINS)
    outcomes = Counter((g.domain, r.outcome) for g in stream for r in g.rollouts)
    assert not [k for k in outcomes if k[1] == "verifier_error"], outcomes
    assert all(g.dropped != "verifier_error" for g in stream)
    problem_ids = {g.domain: {g.problem_id for g2 in stream if g2.domain == g.domain} for g in stream}
    assert any(pid.startswith("bfcl-") for pid in problem_ids["function_calling"])  # the real BFCL extract


def test_the_adaptive_mix_is_active_and_its_counts_match_the_stream(run_dir):
    stream = groups(run_dir)
    snap = StreamWriter(run_dir / "rollouts").last_snapshot()
    counts = Counter()
    for g in stream:
        counts[g.domain] += len(g.rollouts)
    assert snap.sampler["counts"] == {d: counts[d] for d in DOMAIN_MIX_PAPER}
    sampler = AdaptiveDomainSampler(DOMAIN_MIX_PAPER, min_completions=8)
    sampler.load_state_dict(snap.sampler)
    probs, targets = sampler.probabilities(), sampler.targets
    assert sum(counts.values()) >= 8 and any(abs(probs[d] - targets[d]) > 1e-3 for d in targets)


def test_math_rollouts_take_two_turns_token_in_token_out(run_dir):
    """Through real vLLM: a self-check trajectory is the first answer as sampled, the follow-up's
    chat-template tokens, the second answer as sampled; only the model's tokens carry log-probs and
    weight versions; a trajectory with one turn was stopped (its first answer hit the budget)."""
    from megatron_apriel.envs.config import SelfCheckConfig
    from megatron_apriel.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(run_dir / "base")
    rollouts = [r for g in groups(run_dir) if g.domain == "math" for r in g.rollouts]
    two = [r for r in rollouts if len(r.model_turns) == 2]
    assert two, Counter(len(r.model_turns) for r in rollouts)
    assert all(r.truncated for r in rollouts if len(r.model_turns) == 1)
    for r in rollouts:
        assert len(r.model_turns) <= 2 and r.length <= 128
        assert len(r.logprobs) == r.model_length == int(r.mask.sum())
        assert sum(s.end - s.start for s in r.versions) == r.model_length
    for r in two:
        first, second = r.model_turns
        between = tokenizer.decode(r.completion_ids[first.end:second.start].tolist(), skip_special_tokens=False)
        assert SelfCheckConfig().message in between and "<|user|>" in between, between
        assert not r.mask[first.end:second.start].any() and r.mask[second.start:second.end].all()


def test_under_keep_each_model_turn_records_the_version_its_request_was_salted_with(run_dir):
    """Through real vLLM (which accepted every salted request): each model turn is one request, so
    its tokens share one context version, never newer than the weights that sampled them; a later
    turn's request is never salted older than an earlier one's; the stream's stale-cache tokens are
    those sampled by newer weights than their turn's salt."""
    rollouts = [r for g in groups(run_dir) for r in g.rollouts]
    stale = 0
    for r in rollouts:
        assert r.context_versions and r.context_versions[-1].end == r.model_length
        context = _per_model_token(r.context_versions, r.model_length)
        sampled = _per_model_token(r.versions, r.model_length)
        offset, salts = 0, []
        for turn in r.model_turns:
            size = turn.end - turn.start
            assert len(set(context[offset:offset + size])) == 1, (context, r.model_turns)
            salts.append(context[offset])
            offset += size
        assert salts == sorted(salts)
        assert all(c <= v for c, v in zip(context, sampled))
        stale += sum(c < v for c, v in zip(context, sampled))
        assert r.stale_cache().sum() == sum(c < v for c, v in zip(context, sampled))
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert sum(row["rollout/stale_cache_tokens"] for row in rows) <= stale  # groups read by a step (not all)
    assert all(row["rollout/recomputed_tokens"] == 0 for row in rows)  # keep: no request was reset


def _per_model_token(spans, n: int) -> list[int]:
    out = [None] * n
    for s in spans:
        out[s.start:s.end] = [s.version] * (s.end - s.start)
    assert None not in out
    return out
