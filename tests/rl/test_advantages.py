"""Advantages against hand-computed values, and the identities between the methods."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flywheel.agent.trajectory import Status, Trajectory
from flywheel.rl.advantages import (
    AdvantageConfig,
    charge_broken_turns,
    charge_failed_turns,
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


def episode(outcome: float, broken_turns: list[tuple[int, int, int]] = (), n_tokens: int = 12, group: str = "g",
            call_penalty: float = 0.1, max_penalty: float = 0.5) -> Trajectory:
    """A trajectory whose tokens 2.. were generated; its reward is `outcome` minus the broken-call
    penalty, as the episode runner computes it."""
    calls = sum(n for _, _, n in broken_turns)
    penalty = min(max_penalty, call_penalty * calls)
    return Trajectory(task_id="t", family="f", tokens=list(range(n_tokens)), loss_mask=[0, 0] + [1] * (n_tokens - 2),
                      logprobs=[0.0] * n_tokens, versions=[-1, -1] + [0] * (n_tokens - 2), prompt_len=2,
                      status=Status.FINISHED, reward=outcome - penalty,
                      reward_parts={"all_passed_bonus": outcome, "invalid_call_penalty": -penalty},
                      turns=3, tool_calls=3, invalid_tool_calls=calls, asked_question=False,
                      broken_turns=list(broken_turns), group_id=group)


def test_turn_credit_compares_outcomes_and_charges_the_broken_turns_tokens():
    # All three failed; the second broke one call in tokens 4..7, the third two calls in 2..4 and one in 8..10.
    group = [episode(0.0), episode(0.0, [(4, 7, 1)]), episode(0.0, [(2, 4, 2), (8, 10, 1)])]
    # rewards 0, -0.1, -0.3
    assert AdvantageConfig(method="dr_grpo").for_trajectories(group) == pytest.approx([0.4 / 3, 0.1 / 3, -0.5 / 3])
    first, second, third = AdvantageConfig(method="dr_grpo", broken_calls="turn").for_trajectories(group)
    assert first == 0.0  # the outcomes are tied: nothing for tokens that broke nothing
    assert second == pytest.approx([0.0] * 4 + [-0.1] * 3 + [0.0] * 5)
    assert third == pytest.approx([0.0] * 2 + [-0.2] * 2 + [0.0] * 4 + [-0.1] * 2 + [0.0] * 2)


def test_turn_credit_adds_the_charge_to_the_outcome_advantage_and_keeps_the_cap():
    # One passed after a broken call; one failed with 7 broken calls, whose penalty the 0.5 cap holds.
    group = [episode(1.0, [(3, 5, 1)]), episode(0.0, [(2, 9, 7)])]
    passed, failed = AdvantageConfig(method="dr_grpo", broken_calls="turn").for_trajectories(group)
    assert passed == pytest.approx([0.5] * 3 + [0.4] * 2 + [0.5] * 7)  # outcome advantage +0.5, the call -0.1
    assert failed == pytest.approx([-0.5] * 2 + [-1.0] * 7 + [-0.5] * 3)  # -0.5, and the capped 0.5, not 0.7


def test_turn_credit_charges_calls_no_span_records_to_the_whole_episode():
    # Three invalid calls, one recorded in tokens 4..6 (the other two made before a resume from an
    # older saved state): 0.1 on the span, 0.2 on every generated token, none on the prompt.
    t = episode(0.0, [(4, 6, 1)]).model_copy(update={"invalid_tool_calls": 3, "reward": -0.3,
                                                     "reward_parts": {"invalid_call_penalty": -0.3}})
    assert charge_broken_turns(t, 0.5) == pytest.approx([0.5] * 2 + [0.3] * 2 + [0.2] * 2 + [0.3] * 6)


def test_turn_credit_gives_a_group_with_equal_rewards_but_broken_calls_signal():
    tied = [episode(0.0, [(3, 5, 1)]), episode(0.0, [(6, 8, 1)])]  # equal rewards, each broke one call
    assert not AdvantageConfig(broken_calls="episode").has_signal(tied)
    assert AdvantageConfig(broken_calls="turn").has_signal(tied)
    clean = [episode(1.0), episode(1.0)]
    assert not AdvantageConfig(broken_calls="turn").has_signal(clean)
    assert AdvantageConfig(broken_calls="turn").has_signal([episode(1.0), episode(0.0)])


def test_failed_call_cost_charges_the_turns_whose_calls_the_tools_refused():
    # Both failed; the second's turn in tokens 4..7 made two calls the tools refused (no reward part).
    group = [episode(0.0), episode(0.0).model_copy(update={"failed_turns": [(4, 7, 2)]})]
    assert AdvantageConfig(method="dr_grpo").for_trajectories(group) == [0.0, 0.0]  # off: no cost, no signal
    assert not AdvantageConfig(method="dr_grpo").has_signal(group)
    config = AdvantageConfig(method="dr_grpo", failed_call_cost=0.05)
    first, second = config.for_trajectories(group)
    assert first == 0.0
    assert second == pytest.approx([0.0] * 4 + [-0.1] * 3 + [0.0] * 5)
    assert config.has_signal(group)  # tied outcomes, but a turn to push down


def test_failed_call_cost_adds_to_the_outcome_advantage_and_to_broken_turn_credit():
    passed = episode(1.0, [(2, 4, 1)]).model_copy(update={"failed_turns": [(6, 8, 1)]})
    failed = episode(0.0).model_copy(update={"failed_turns": [(3, 5, 1), (8, 12, 3)]})
    config = AdvantageConfig(method="dr_grpo", broken_calls="turn", failed_call_cost=0.1)
    a_passed, a_failed = config.for_trajectories([passed, failed])
    assert a_passed == pytest.approx([0.5] * 2 + [0.4] * 2 + [0.5] * 2 + [0.4] * 2 + [0.5] * 4)
    assert a_failed == pytest.approx([-0.5] * 3 + [-0.6] * 2 + [-0.5] * 3 + [-0.8] * 4)
    assert charge_failed_turns(episode(0.0), 0.25, 0.1) == 0.25  # nothing refused: the number stays a number
    with pytest.raises(ValueError, match="failed turn"):  # tokens 0 and 1 are the prompt, not a turn
        Trajectory.model_validate(episode(0.0).model_dump() | {"failed_turns": [(0, 3, 1)]})
