"""The Trajectory record checks itself: per-token arrays, spans, and a reward that its parts add up to."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from flywheel.agent.trajectory import Status, Trajectory


def record(reward: float, parts: dict[str, float], tokens: int = 3, **fields) -> Trajectory:
    return Trajectory(task_id="t", family="f", tokens=[1] * tokens, loss_mask=[0] + [1] * (tokens - 1),
                      logprobs=[0.0] + [-0.5] * (tokens - 1), versions=[-1] + [0] * (tokens - 1), prompt_len=1,
                      status=Status.FINISHED, reward=reward, reward_parts=parts, turns=1, tool_calls=1,
                      invalid_tool_calls=1, asked_question=False, **fields)


def test_the_routing_record_is_packed_in_json_and_reads_back_exactly():
    """48 layers x top-8 of 128 experts: one byte per id in JSON (a third of the lists' size), the
    tokens without a record kept apart; 300 experts take two bytes; lists of older records still read."""
    rng = random.Random(0)
    routed = [[rng.randrange(128) for _ in range(48 * 8)] for _ in range(40)]
    routed[5], routed[-1] = [], []  # an engine that died had fed it; the last token, never fed
    t = record(0.0, {}, tokens=40, routed_experts=routed)
    packed = json.loads(t.model_dump_json())["routed_experts"]
    assert packed["dtype"] == "uint8" and packed["width"] == 384
    assert Trajectory.model_validate_json(t.model_dump_json()).routed_experts == routed
    per_token = len(json.dumps(packed)) / 38
    assert 512 <= per_token < 530 and per_token < len(json.dumps(routed)) / 38 / 2.5
    wide = [[299, 0], [], [7, 256]]
    assert json.loads(record(0.0, {}, routed_experts=wide).model_dump_json())["routed_experts"]["dtype"] == "uint16"
    assert Trajectory.model_validate(json.loads(record(0.0, {}, routed_experts=wide).model_dump_json())
                                     ).routed_experts == wide
    legacy = json.loads(record(0.0, {}, routed_experts=wide).model_dump_json())
    legacy["routed_experts"] = wide
    assert Trajectory.model_validate(legacy).routed_experts == wide
    cut = json.loads(record(0.0, {}, routed_experts=wide).model_dump_json())
    cut["routed_experts"]["ids"] = cut["routed_experts"]["ids"][:8]  # 3 of the 4 ids
    with pytest.raises(ValidationError, match="the record is cut"):
        Trajectory.model_validate(cut)


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
