import json
import math
import random
import threading
import time

import numpy as np
import pytest

from megatron_apriel.sampling import DOMAIN_MIX_PAPER, DOMAIN_MIX_PIPELINERL, AdaptiveDomainSampler, SamplerConfig
from megatron_apriel.sampling.domain_sampler import state_from_v2


def expected_probs(weights, counts, min_completions=50, lo=0.1, hi=10.0):
    """RECIPE.md section 3, written independently of the implementation (vectorised)."""
    names = list(weights)
    w = np.array([weights[d] for d in names], dtype=float)
    n = np.array([counts.get(d, 0) for d in names], dtype=float)
    t = w / w.sum()
    if n.sum() < min_completions:
        return dict(zip(names, t))
    share = n / n.sum()
    with np.errstate(divide="ignore"):
        alpha = np.where(n == 0, hi, np.clip(t / np.where(n == 0, 1, share), lo, hi))
    p = w * alpha
    return dict(zip(names, p / p.sum()))


def test_presets_sum_to_one():
    assert sum(DOMAIN_MIX_PAPER.values()) == pytest.approx(1.0)
    assert sum(DOMAIN_MIX_PIPELINERL.values()) == pytest.approx(1.0)
    assert DOMAIN_MIX_PAPER["math"] == 0.40 and DOMAIN_MIX_PIPELINERL["ifeval"] == 0.15


@pytest.mark.parametrize("trial", range(20))
def test_probabilities_match_formula_after_random_completions(trial):
    rng = random.Random(trial)
    weights = {d: rng.uniform(0.05, 3.0) for d in ["a", "b", "c", "d"][: rng.randint(1, 4)]}
    sampler = AdaptiveDomainSampler(weights, seed=trial)
    counts = {}
    for _ in range(rng.randint(0, 40)):
        d = rng.choice(list(weights)[:max(1, len(weights) - 1)])  # some domain may stay at 0
        n = rng.randint(1, 8)
        sampler.record_completion(d, n)
        counts[d] = counts.get(d, 0) + n
        got, want = sampler.probabilities(), expected_probs(weights, counts)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-15)
        assert sum(got.values()) == pytest.approx(1.0)


def test_static_until_min_completions_and_zero_count_gets_clip_high():
    s = AdaptiveDomainSampler({"a": 1.0, "b": 3.0})
    s.record_completion("a", 49)
    assert s.probabilities() == pytest.approx({"a": 0.25, "b": 0.75})
    s.record_completion("a")  # N = 50, b never completed: alpha_a = clip(0.25/1)=0.25, alpha_b = 10
    assert s.probabilities()["b"] == pytest.approx(3 * 10 / (3 * 10 + 1 * 0.25))


@pytest.mark.parametrize("count", ["completed", "trained"])
def test_state_dict_round_trip_continues_same_sequence(count):
    """Resume is exact with either count: same draws, same counts, both of them."""
    drop = random.Random(5)  # which groups are dropped: the same for both samplers
    a = AdaptiveDomainSampler(DOMAIN_MIX_PAPER, seed=7, count=count)
    for _ in range(100):
        a.record_completion(a.sample(), 8, trained=drop.random() < 0.6)
    state = json.loads(json.dumps(a.state_dict()))  # must survive JSON
    assert state["count"] == count and state["counts"] == a.counts() and state["trained"] == a.counts("trained")
    b = AdaptiveDomainSampler(DOMAIN_MIX_PAPER, seed=999, count=count)
    b.load_state_dict(state)
    assert b.probabilities() == a.probabilities()
    seq_a, seq_b = [], []
    for _ in range(200):
        da, db = a.sample(), b.sample()
        seq_a.append(da)
        seq_b.append(db)
        kept = drop.random() < 0.6
        a.record_completion(da, 8, trained=kept)
        b.record_completion(db, 8, trained=kept)
    assert seq_a == seq_b
    assert a.counts() == b.counts() and a.counts("trained") == b.counts("trained")
    assert a.counts() != a.counts("trained")  # some groups were dropped: the two counts differ
    assert len(set(seq_a)) > 1


def test_the_chosen_count_steers_and_both_are_kept():
    """count=trained applies the formula to the trained rollouts; completed to all of them."""
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    completed, trained = {"a": 50, "b": 30, "c": 20}, {"a": 10, "b": 30, "c": 20}  # a: 40 dropped
    samplers = {c: AdaptiveDomainSampler(weights, min_completions=50, count=c) for c in ("completed", "trained")}
    for s in samplers.values():
        for d in weights:
            s.record_completion(d, trained[d])
        s.record_completion("a", completed["a"] - trained["a"], trained=False)
        assert s.counts() == completed and s.counts("trained") == trained
    assert samplers["completed"].probabilities() == pytest.approx(expected_probs(weights, completed), rel=1e-12)
    # count=trained: the formula on the completed counts towards t_d / k_d (a keeps 1 in 5: k_a = 0.2)
    goal = {"a": 0.5 / 0.2, "b": 0.3, "c": 0.2}
    assert samplers["trained"].probabilities() == pytest.approx(expected_probs(goal, completed), rel=1e-12)
    # the completed mix is on target; the trained mix (60 rollouts >= min_completions) is short of a
    assert samplers["completed"].probabilities()["a"] == pytest.approx(0.5)
    assert samplers["trained"].probabilities()["a"] > 0.7


def test_the_warm_up_counts_the_chosen_count():
    s = AdaptiveDomainSampler({"a": 1.0, "b": 1.0}, min_completions=50, count="trained")
    s.record_completion("a", 60, trained=False)  # 60 completed, none trained: still static
    assert s.probabilities() == {"a": 0.5, "b": 0.5}
    s.record_completion("a", 50)  # 110 completed, 50 kept; b: nothing yet (k_b = 1, completed 0: clip_high)
    assert s.probabilities() == pytest.approx(expected_probs({"a": 0.5 * 110 / 50, "b": 0.5}, {"a": 110}))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_count_trained_holds_the_trained_mix_where_domains_are_dropped_at_different_rates(seed):
    """Groups of 8, each kept with its domain's rate (the mechanisms benchmark's: math 0.51, code
    0.76, logic 0.57): after 600 groups the trained mix is within 1.5 pp of the target with
    count=trained; counting completed rollouts, the recipe's rule leaves it several pp off."""
    weights, keep = {"math": 0.40, "code": 0.25, "logic": 0.15}, {"math": 0.51, "code": 0.76, "logic": 0.57}
    targets = {d: w / sum(weights.values()) for d, w in weights.items()}
    error = {}
    for count in ("completed", "trained"):
        s, rng = AdaptiveDomainSampler(weights, min_completions=50, count=count, seed=seed), random.Random(seed)
        for _ in range(600):
            d = s.sample()
            s.record_completion(d, 8, trained=rng.random() < keep[d])
        kept = s.counts("trained")
        error[count] = max(abs(kept[d] / sum(kept.values()) - targets[d]) for d in weights)
    assert error["trained"] < 0.015 and error["completed"] > 0.04, error


def test_count_is_validated():
    with pytest.raises(ValueError, match="actor.sampler.count='kept'"):
        AdaptiveDomainSampler({"a": 1.0}, count="kept")
    with pytest.raises(ValueError, match="kind"):
        AdaptiveDomainSampler({"a": 1.0}).counts("kept")


def test_a_version_2_state_resumes_with_its_trained_counts_recounted():
    current = AdaptiveDomainSampler({"a": 1.0, "b": 2.0}, seed=4)
    for _ in range(30):
        current.record_completion(current.sample(), 4, trained=False)
    v2 = {k: v for k, v in json.loads(json.dumps(current.state_dict())).items() if k not in ("trained", "count")}
    v2["version"] = 2
    with pytest.raises(ValueError, match="state_from_v2"):
        AdaptiveDomainSampler({"a": 1.0, "b": 2.0}).load_state_dict(v2)
    resumed = AdaptiveDomainSampler({"a": 1.0, "b": 2.0}, seed=9)
    resumed.load_state_dict(state_from_v2(v2, {"a": 0}))  # a domain with no trained rollout may be left out
    assert resumed.counts() == current.counts() and resumed.counts("trained") == {"a": 0, "b": 0}
    assert [resumed.sample() for _ in range(50)] == [current.sample() for _ in range(50)]
    with pytest.raises(ValueError, match="version 3"):
        state_from_v2(current.state_dict(), {})


def test_seed_determines_sequence():
    def seq(seed):
        s = AdaptiveDomainSampler(DOMAIN_MIX_PAPER, seed=seed)
        return [s.sample() for _ in range(50)]
    assert seq(1) == seq(1) and seq(1) != seq(2)


class _YieldingCounts(dict):
    """Counts whose every read hands the GIL to another thread: an unlocked ``counts[d] += n`` then
    interleaves across threads and loses updates (the GIL alone makes the three bytecodes of
    ``+=`` effectively atomic, so without this the test would pass with the lock removed)."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        time.sleep(0)
        return value


def test_thread_safe_counts():
    s = AdaptiveDomainSampler(DOMAIN_MIX_PAPER)
    s._counts = _YieldingCounts(s._counts)  # the seam: reads of the counts now switch threads

    def work():
        for _ in range(500):
            s.record_completion(s.sample())
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(s.counts().values()) == 2000


@pytest.mark.parametrize("weights", [{}, {"a": 0.0}, {"a": -1.0}, {"a": float("nan")}, {"": 1.0}])
def test_bad_weights_raise(weights):
    with pytest.raises(ValueError):
        AdaptiveDomainSampler(weights)


def test_unknown_domain_and_bad_counts_raise():
    s = AdaptiveDomainSampler({"a": 1.0})
    with pytest.raises(ValueError, match="unknown domain"):
        s.record_completion("b")
    with pytest.raises(ValueError):
        s.record_completion("a", 0)
    with pytest.raises(ValueError):
        SamplerConfig(clip_low=2.0)


@pytest.mark.parametrize("corrupt,match", [
    (lambda st: st.update(version=1), "version 1"),
    (lambda st: st.update(version=2), "state_from_v2"),
    (lambda st: st.pop("version"), "version None"),
    (lambda st: st["counts"].update(z=3), "same domain set"),
    (lambda st: st["counts"].pop("a"), "same domain set"),
    (lambda st: st["counts"].update(a=-1), "non-negative integers"),
    (lambda st: st["counts"].update(a=2.5), "non-negative integers"),
    (lambda st: st.update(draws="iid"), "same sampler configuration"),
    (lambda st: st["trained"].pop("b"), "same domain set"),
    (lambda st: st["trained"].update(a=-1), "non-negative integers"),
    (lambda st: st["trained"].update(a=st["counts"]["a"] + 1), "exceed the completed counts"),
], ids=["old_version", "v2", "no_version", "extra_domain", "missing_domain", "negative_count", "float_count", "draws",
        "trained_missing_domain", "trained_negative", "trained_above_completed"])
def test_load_state_dict_refuses_each_bad_state_and_keeps_its_own(corrupt, match):
    weights = {"a": 1.0, "b": 2.0}
    saved = AdaptiveDomainSampler(weights, seed=1)
    for i in range(30):
        saved.record_completion(saved.sample(), 4, trained=i % 3 > 0)
    state = json.loads(json.dumps(saved.state_dict()))
    corrupt(state)
    target = AdaptiveDomainSampler(weights, seed=2)
    target.record_completion("b", 7)
    before = target.state_dict()
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(state)
    assert target.state_dict() == before  # nothing half-loaded


CLIP_WEIGHTS = {"a": 0.2, "b": 0.3, "c": 0.4, "d": 0.1}
CLIP_COUNTS = {"a": 60, "b": 30, "c": 10}  # raw factors t/share: a 1/3, b 1, c 4; d never completed


@pytest.mark.parametrize("clip", [(0.5, 2.0), (1.0, 1.0), (0.4, 3.0)])
def test_non_default_clip_bounds_the_correction(clip):
    lo, hi = clip
    want = expected_probs(CLIP_WEIGHTS, CLIP_COUNTS, lo=lo, hi=hi)
    assert max(abs(want[d] - p) for d, p in expected_probs(CLIP_WEIGHTS, CLIP_COUNTS).items()) > 0.05  # it binds
    direct = AdaptiveDomainSampler(CLIP_WEIGHTS, clip=clip)
    built = SamplerConfig(weights=dict(CLIP_WEIGHTS), clip_low=lo, clip_high=hi).build()
    for s in (direct, built):
        for d, n in CLIP_COUNTS.items():
            s.record_completion(d, n)
        assert s.probabilities() == pytest.approx(want, rel=1e-12)


def test_config_builds_default_paper_mix():
    s = SamplerConfig().build()
    assert s.targets == pytest.approx(dict(DOMAIN_MIX_PAPER))


def test_low_discrepancy_draws_follow_p_closely_and_iid_draws_follow_it_loosely():
    """Both modes pick domain d with probability p_d; the golden-ratio draws spread evenly."""
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    gaps = {}
    for draws in ("low_discrepancy", "iid"):
        sampler = AdaptiveDomainSampler(weights, min_completions=10**9, seed=3, draws=draws)  # static p = t
        picks = [sampler.sample() for _ in range(1000)]
        gaps[draws] = max(abs(picks.count(d) / 1000 - w) for d, w in weights.items())
    assert gaps["low_discrepancy"] < 0.003  # within 3 picks of 1000
    assert gaps["iid"] < 0.06  # binomial noise, sd ~0.016


def test_draws_mode_is_validated_and_part_of_the_state():
    with pytest.raises(ValueError, match="draws"):
        AdaptiveDomainSampler({"a": 1.0}, draws="sobol")
    saved = AdaptiveDomainSampler({"a": 1.0, "b": 1.0}, draws="iid").state_dict()
    with pytest.raises(ValueError, match="draws"):
        AdaptiveDomainSampler({"a": 1.0, "b": 1.0}).load_state_dict(saved)


SKEW_WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}
SKEW_COUNTS = {"a": 85, "b": 10, "c": 5}  # a ran ahead of its share: p = (0.15, 0.45, 0.40), far from t


@pytest.mark.parametrize("draws", ["iid", "low_discrepancy"])
def test_adaptive_draws_follow_the_adapted_probabilities(draws):
    """After the warm-up, draws follow probabilities(), not the targets.

    No completion is recorded while drawing, so p stays fixed and each draw picks d with probability
    p_d: the count of d over K draws is Binomial(K, p_d) for i.i.d. draws, with std
    sqrt(p_d (1 - p_d) / K) <= 0.0035 as a frequency at K = 20,000. The bound is 5 std (a chance
    below 1e-6 per domain that any seed fails), far below the gap |p_d - t_d| > 0.1 a sampler
    drawing from the targets would show. Golden-ratio draws are not independent, but their
    frequency error is O(log K / K), well inside the same bound.
    """
    k = 20_000
    sampler = AdaptiveDomainSampler(SKEW_WEIGHTS, min_completions=50, seed=11, draws=draws)
    for d, n in SKEW_COUNTS.items():
        sampler.record_completion(d, n)
    p = expected_probs(SKEW_WEIGHTS, SKEW_COUNTS)
    assert sampler.probabilities() == pytest.approx(p, rel=1e-12)
    assert min(abs(p[d] - t) for d, t in sampler.targets.items()) > 0.1
    picks = [sampler.sample() for _ in range(k)]
    for d in SKEW_WEIGHTS:
        tolerance = 5 * math.sqrt(p[d] * (1 - p[d]) / k)
        assert abs(picks.count(d) / k - p[d]) < tolerance, (d, picks.count(d) / k, p[d], tolerance)
