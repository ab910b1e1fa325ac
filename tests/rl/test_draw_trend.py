"""bench/draw_trend.py on draws whose truth is known: a harder draw under a fixed policy, and a
policy getting worse under a fixed draw, must come out as different series' slopes."""

from __future__ import annotations

from bench.draw_trend import draw_trend


def step(n: int, groups: list[tuple[str, int, int]]) -> dict:
    """A metrics.jsonl line: `groups` as (family, difficulty, passes of 8)."""
    draw = [{"family": f, "difficulty": d, "passed": p, "episodes": 8} for f, d, p in groups]
    return {"step": n, "reward_mean": sum(p for _, _, p in groups) / (8 * len(groups)), "draw": draw}


def test_a_harder_draw_and_a_worse_policy_are_told_apart():
    # a fixed policy (easy cells pass 6 of 8, hard ones 1 of 8), drawing more hard groups each step
    harder = [step(n, [("implement", 1, 6)] * (4 - n // 3) + [("crossfile", 3, 1)] * (n // 3)) for n in range(12)]
    result = draw_trend(harder)
    assert result["steps"] == 12 and result["reward_mean"]["ci"][1] < 0  # the reward falls...
    assert result["draw_expected"]["ci"][1] < 0  # ...because the draw got harder
    assert abs(result["pass_minus_expected"]["slope_per_step"]) < 1e-9  # not the policy
    # the same two cells every step, the policy passing fewer of each
    worse = [step(n, [("implement", 1, 7 - n // 2), ("crossfile", 3, 3 - n // 4)]) for n in range(12)]
    result = draw_trend(worse)
    assert abs(result["draw_expected"]["slope_per_step"]) < 1e-9
    assert result["pass_minus_expected"]["ci"][1] < 0 and result["pass_minus_expected"]["thirds"][0] > 0
