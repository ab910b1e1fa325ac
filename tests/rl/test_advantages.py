"""Advantages against hand-computed values, and the identities between the methods."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flywheel.rl.advantages import (
    AdvantageConfig,
    compute_advantages,
    group_has_signal,
    outcome_tied,
    zero_signal_groups,
)

REWARDS = [1.0, 0.0, 0.0, 2.0, 2.0, 5.0]
GROUPS = ["a", "a", "a", "b", "b", "c"]  # a: has signal; b: all equal; c: alone
SQRT3 = math.sqrt(3)


def test_grpo_divides_by_the_sample_std_of_the_group():
    # group a: mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = 1/sqrt(3)
    got = compute_advantages(REWARDS, GROUPS, method="grpo", eps=0.0)
    assert got == pytest.approx([2 / 3 * SQRT3, -1 / 3 * SQRT3, -1 / 3 * SQRT3, 0, 0, 0])
    with_eps = compute_advantages(REWARDS, GROUPS, method="grpo", eps=0.1)
    assert with_eps[0] == pytest.approx((2 / 3) / (1 / SQRT3 + 0.1))


def test_grpo_without_std_is_dr_grpo():
    expected = [2 / 3, -1 / 3, -1 / 3, 0, 0, 0]
    assert compute_advantages(REWARDS, GROUPS, method="dr_grpo") == pytest.approx(expected)
    assert compute_advantages(REWARDS, GROUPS, method="grpo", scale_by_std=False) == pytest.approx(expected)
    assert AdvantageConfig(method="grpo", scale_by_std=False).compute(REWARDS, GROUPS) == pytest.approx(expected)


def test_rloo_subtracts_the_mean_of_the_other_members():
    # 1 - mean(0, 0); 0 - mean(1, 0); ...
    assert compute_advantages(REWARDS, GROUPS, method="rloo") == pytest.approx([1.0, -0.5, -0.5, 0, 0, 0])


def test_family_leave_one_out_ignores_groups():
    rewards = [1.0, 0.0, 0.5, 3.0, 4.0, 4.0]
    families = ["x", "x", "x", "y", "z", "z"]  # y alone, z all equal
    got = compute_advantages(rewards, [""] * 6, families, method="family_loo")
    assert got == pytest.approx([1 - 0.25, 0 - 0.75, 0.5 - 0.5, 0, 0, 0])
    assert AdvantageConfig(method="family_loo").compute(rewards, [""] * 6, families) == pytest.approx(got)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_single_member_and_all_equal_groups_get_exactly_zero(method):
    rewards = [0.1, 0.1, 0.1, 0.7, 0.3]  # (0.1 + 0.1 + 0.1) / 3 != 0.1 in floats: must still be 0, not residue
    got = compute_advantages(rewards, ["a", "a", "a", "b", "c"], method=method)
    assert got == [0.0] * 5


def test_signal_counting():
    assert group_has_signal([0.0, 1.0])
    assert not group_has_signal([0.5, 0.5, 0.5])
    assert not group_has_signal([1.0])
    assert not group_has_signal([0.1 + 0.2, 0.3])  # the same reward summed in another order
    assert zero_signal_groups(REWARDS, GROUPS) == 2  # b (all equal) and c (alone)


def test_bad_inputs_say_what_to_fix():
    with pytest.raises(ValueError, match="group_id"):
        compute_advantages([1.0, 0.0], ["a", ""], method="grpo")
    with pytest.raises(ValueError, match="families="):
        compute_advantages([1.0, 0.0], ["a", "a"], method="family_loo")
    with pytest.raises(ValueError, match="finite"):
        compute_advantages([1.0, float("nan")], ["a", "a"], method="rloo")
    with pytest.raises(ValueError, match="one group id per episode"):
        compute_advantages([1.0, 0.0], ["a"], method="rloo")


rewards_st = st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=12)


@given(rewards_st, st.integers(1, 4))
def test_identities_between_the_methods(rewards, n_groups):
    groups = [f"g{i % n_groups}" for i in range(len(rewards))]
    grpo = compute_advantages(rewards, groups, method="grpo")
    dr = compute_advantages(rewards, groups, method="dr_grpo")
    rloo = compute_advantages(rewards, groups, method="rloo")
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        size = len(idx)
        assert abs(sum(dr[i] for i in idx)) < 1e-9 * (1 + max(abs(r) for r in rewards)) * size
        for i in idx:
            assert rloo[i] == pytest.approx(dr[i] * size / (size - 1) if size > 1 else 0.0, abs=1e-9)
            assert (grpo[i] > 0) == (dr[i] > 0) and (grpo[i] < 0) == (dr[i] < 0)
    # family_loo over families is rloo over groups with the same partition
    assert compute_advantages(rewards, [""] * len(rewards), groups, method="family_loo") == pytest.approx(rloo)


@given(st.floats(-10, 10, allow_nan=False), st.integers(1, 8))
def test_equal_rewards_have_no_signal(reward, size):
    assert compute_advantages([reward] * size, ["g"] * size, method="grpo") == [0.0] * size
    assert zero_signal_groups([reward] * size, ["g"] * size) == 1


def test_a_group_that_differs_only_in_penalties_is_outcome_tied():
    assert outcome_tied([False, False, False], [0.0, -0.1, 0.0])  # all failed; one broken call
    assert outcome_tied([True, True], [1.0, 0.9])
    assert not outcome_tied([False, True, False], [0.0, 1.0, -0.1])  # success differs: the real signal
    assert not outcome_tied([False, False], [0.0, 0.0])  # no signal at all
