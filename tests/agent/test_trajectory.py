"""The Trajectory record checks itself: per-token arrays, spans, and a reward that its parts add up to."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flywheel.agent.trajectory import Status, Trajectory


def record(reward: float, parts: dict[str, float]) -> Trajectory:
    return Trajectory(task_id="t", family="f", tokens=[1, 2, 3], loss_mask=[0, 1, 1],
                      logprobs=[0.0, -0.5, -0.5], versions=[-1, 0, 0], prompt_len=1, status=Status.FINISHED,
                      reward=reward, reward_parts=parts, turns=1, tool_calls=1, invalid_tool_calls=1,
                      asked_question=False)


def test_reward_parts_are_the_rewards_additive_terms():
    # Summed in another order than the grader and the episode runner add them: equal up to the last bits.
    t = record(0.5 * (2 / 3) + 0.5 * 0.0 - 0.1 * 0.0 - 0.1,
               {"invalid_call_penalty": -0.1, "visible_tests_penalty": -0.0, "pass_frac": 0.5 * (2 / 3),
                "all_passed_bonus": 0.0})
    assert not t.all_passed  # never graded: no outcome
    with pytest.raises(ValidationError, match="sum to 1.1, not to the reward 0.1"):
        record(0.1, {"pass_frac": 1.0, "invalid_call_penalty": 0.1})
    with pytest.raises(ValidationError, match=r"\['invalid_tool_calls'\].*start a new run_dir"):
        # a count is not a term
        record(0.4, {"all_passed": 0.5, "invalid_tool_calls": 1.0, "invalid_call_penalty": -0.1})
    with pytest.raises(ValidationError, match="sum to 0"):
        record(1.0, {})
