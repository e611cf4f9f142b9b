import pytest

from megatron_apriel.rewards import (
    RewardConfig,
    difficulty_aware_rewards,
    group_advantages,
    group_solve_rate,
    is_zero_advantage_group,
    length_penalty,
    shape_group_rewards,
)

L, B = 100, 20  # penalty zone (80, 100]


def test_length_penalty_values():
    assert length_penalty(50, L, B) == 0.0
    assert length_penalty(80, L, B) == 0.0
    assert length_penalty(90, L, B) == pytest.approx(-0.5)
    assert length_penalty(100, L, B) == pytest.approx(-1.0)
    assert length_penalty(85, L, 0) == 0.0
    with pytest.raises(ValueError):
        length_penalty(10, 10, 20)


def test_dap_mixed_group_hand_computed():
    # 4 rollouts: 2 correct (lengths 90, 50), 1 wrong (95), 1 truncated at the cap (100).
    rewards = [1.0, 1.0, 0.0, 0.0]
    lengths = [90, 50, 95, 100]
    correct = [True, True, False, False]
    truncated = [False, False, False, True]
    s = 2 / 4
    want = [1.0 + s * -0.5,           # correct, lambda = s**1
            1.0,                      # outside the zone
            0.0 + 1.0 * -0.75,        # wrong, lambda_f = 1
            0.0 + 1.0 * -1.0]         # hard cap: lambda = 1
    got = difficulty_aware_rewards(rewards, lengths, correct, truncated, L, B, gamma=1.0, failure_scale=1.0)
    assert got == pytest.approx(want)
    # gamma = 2 and failure_scale = 0.5
    got = difficulty_aware_rewards(rewards, lengths, correct, truncated, L, B, gamma=2.0, failure_scale=0.5)
    assert got == pytest.approx([1.0 + 0.25 * -0.5, 1.0, 0.5 * -0.75, -1.0])


def test_dap_all_correct_gets_full_penalty_and_is_not_filtered():
    rewards, lengths = [1.0] * 4, [85, 90, 60, 70]
    got = difficulty_aware_rewards(rewards, lengths, [True] * 4, [False] * 4, L, B)
    assert got == pytest.approx([0.75, 0.5, 1.0, 1.0])
    adv = group_advantages(got)
    # LOO by hand: r_i - mean of the other three
    others = [(sum(got) - r) / 3 for r in got]
    assert adv == pytest.approx([r - o for r, o in zip(got, others)])
    assert not is_zero_advantage_group(adv)


def test_dap_one_of_eight_solved():
    correct = [True] + [False] * 7
    got = difficulty_aware_rewards([1.0] + [0.0] * 7, [90] * 8, correct, [False] * 8, L, B)
    assert got[0] == pytest.approx(1.0 - 0.5 / 8)
    assert got[1:] == pytest.approx([-0.5] * 7)
    assert group_solve_rate(correct) == 1 / 8


def test_truncated_below_cap_uses_failure_scale():
    got = difficulty_aware_rewards([0.0, 1.0], [90, 10], [False, True], [True, False], L, B, failure_scale=0.0)
    assert got == pytest.approx([0.0, 1.0])


def test_advantages_loo_and_group_norm_by_hand():
    r = [1.0, 0.0, 0.0, 1.0]
    assert group_advantages(r, "loo") == pytest.approx([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    # mean 0.5, population std 0.5
    assert group_advantages(r, "group_norm", eps=1e-4) == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001] * 1
                                                                         + [-0.5 / 0.5001, 0.5 / 0.5001])
    with pytest.raises(ValueError):
        group_advantages([1.0])
    with pytest.raises(ValueError):
        group_advantages(r, "bogus")


def test_zero_advantage_filter():
    assert is_zero_advantage_group(group_advantages([1.0] * 8))
    assert is_zero_advantage_group(group_advantages([0.0] * 8))
    assert not is_zero_advantage_group(group_advantages([1.0] + [0.0] * 7))


def test_shape_group_rewards_switches_dap():
    cfg = RewardConfig(max_len=L, buffer=B, dap_enabled=False)
    assert shape_group_rewards(cfg, [1.0, 0.0], [90, 90], [True, False], [False, False]) == pytest.approx([0.5, -0.5])
    cfg = RewardConfig(max_len=L, buffer=B)
    assert shape_group_rewards(cfg, [1.0, 0.0], [90, 90], [True, False], [False, False]) == pytest.approx([0.75, -0.5])


def test_config_validation_and_length_mismatch():
    with pytest.raises(ValueError):
        RewardConfig(buffer=20000)
    with pytest.raises(ValueError):
        RewardConfig(advantage_mode="std")
    with pytest.raises(ValueError, match="differ in length"):
        difficulty_aware_rewards([1.0], [1, 2], [True], [False], L, B)
