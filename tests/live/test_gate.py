"""The gate's paired non-inferiority test and its combined decision."""

from __future__ import annotations

import random

import pytest

from flywheel.agent.episode import EpisodeConfig
from flywheel.agent.trajectory import Status, Trajectory
from flywheel.env.outcome import TestOutcome
from flywheel.env.task import Task, TaskMetadata
from flywheel.live.gate import (
    EvalBattery,
    Gate,
    GateConfig,
    NonInferiorityCheck,
    RateLimitCheck,
    non_inferiority,
    rate_limit,
    task_results,
)


def paired(n: int, p: float, worse: float, seed: int) -> tuple[list[float], list[float]]:
    """production ~ Bernoulli(p) per task; candidate loses each production success with prob `worse`."""
    rng = random.Random(seed)
    production = [float(rng.random() < p) for _ in range(n)]
    candidate = [x if rng.random() >= worse else 0.0 for x in production]
    return candidate, production


@pytest.mark.parametrize("name,candidate,production,margin,passes", [
    ("identical", *paired(100, 0.6, 0.0, 0), 0.05, True),
    ("30% worse on 100 tasks", *paired(100, 0.6, 0.3, 1), 0.05, False),
    ("slightly better", [1.0] * 60 + [0.0] * 40, [1.0] * 55 + [0.0] * 45, 0.05, True),
    ("uniformly worse by more than the margin", [0.3] * 50, [0.5] * 50, 0.1, False),
    ("uniformly worse by less than the margin", [0.45] * 50, [0.5] * 50, 0.1, True),
    ("too few tasks fails closed", [1.0] * 5, [1.0] * 5, 0.05, False),
])
def test_non_inferiority(name, candidate, production, margin, passes):
    result = non_inferiority(candidate, production, margin)
    assert result.passed is passes, result.reason
    if result.n >= 20:
        assert result.ci_low <= result.diff <= result.ci_high


def test_false_pass_rate_at_the_margin_is_about_alpha():
    # Candidate truly `margin` worse (0.6 * 1/6 = 0.1): the gate may pass it at most ~alpha of the time.
    trials = [non_inferiority(*paired(200, 0.6, 1 / 6, seed), margin=0.1, alpha=0.05) for seed in range(400)]
    assert {t.method for t in trials} == {"tango"}
    assert sum(t.passed for t in trials) / 400 < 0.08


def test_unpaired_inputs_are_an_error():
    with pytest.raises(ValueError, match="same tasks"):
        non_inferiority([1.0, 0.0], [1.0], margin=0.05)


@pytest.mark.parametrize("values,max_rate,passes", [
    ([True] * 10 + [False] * 90, 0.2, True),
    ([True] * 30 + [False] * 70, 0.2, False),
    ([], 0.2, False),
])
def test_rate_limit(values, max_rate, passes):
    assert rate_limit(values, max_rate).passed is passes


def results(n: int, passed: list[float], asked_clear: int = 0, valid: float = 1.0) -> dict[str, dict]:
    """n tasks; every 4th ambiguous; the first `asked_clear` clear tasks asked a question; the valid
    tool-call rate is `valid` times a per-task rate (the same for every version)."""
    out, clear_seen, rng = {}, 0, random.Random(3)
    for i in range(n):
        ambiguous = i % 4 == 0
        asked = False
        if not ambiguous:
            asked, clear_seen = clear_seen < asked_clear, clear_seen + 1
        out[f"t{i}"] = {"passed": passed[i], "valid_tool_call_rate": valid * rng.choice([1.0, 1.0, 0.9, 0.75]),
                        "asked_question": asked,
                        "ambiguous": ambiguous}
    return out


@pytest.mark.parametrize("name,candidate_kwargs,passes,failed", [
    ("same as production", {}, True, []),
    ("degraded pass rate", {"worse": 0.3}, False, ["pass_rate"]),
    ("asks on clear tasks", {"asked_clear": 40}, False, ["clarify_on_clear"]),
    ("breaks tool calls", {"valid": 0.8}, False, ["valid_tool_call_rate"]),
])
def test_gate_combines_checks(name, candidate_kwargs, passes, failed):
    cand_passed, prod_passed = paired(100, 0.6, candidate_kwargs.get("worse", 0.0), 7)
    production = results(100, prod_passed, asked_clear=5)
    candidate = results(100, cand_passed, candidate_kwargs.get("asked_clear", 5), candidate_kwargs.get("valid", 1.0))
    decision = Gate().decide(candidate, production)
    assert decision.passed is passes
    assert decision.failed == failed
    assert set(decision.checks) == {"pass_rate", "valid_tool_call_rate", "clarify_on_clear"}
    assert decision.checks["clarify_on_clear"].n == 75  # only the clear tasks


def test_gate_pairs_by_task_and_skips_undefined_metrics():
    production = {f"t{i}": {"passed": float(i % 2), "valid_tool_call_rate": None if i < 10 else i / 40}
                  for i in range(60)}
    candidate = {f"t{i}": {"passed": float(i % 2), "valid_tool_call_rate": i / 40} for i in reversed(range(60))}
    config = GateConfig(checks={"valid": NonInferiorityCheck(metric="valid_tool_call_rate", margin=0.01),
                                "errors": NonInferiorityCheck(metric="passed", higher_is_better=False)})
    decision = Gate(config).decide(candidate, production)
    assert decision.checks["valid"].n == 50 and decision.checks["valid"].method == "t"
    assert decision.checks["errors"].method == "tango" and decision.passed


@pytest.mark.parametrize("errors_added,passes", [(0.0, True), (0.3, False)])
def test_lower_is_better_metric(errors_added, passes):
    # "failed" is 1 when the task failed: a candidate failing 30% more tasks must not pass.
    cand, prod = paired(100, 0.6, errors_added, 11)
    config = GateConfig(checks={"failed": NonInferiorityCheck(metric="failed", higher_is_better=False)})
    decision = Gate(config).decide({f"t{i}": {"failed": 1 - v} for i, v in enumerate(cand)},
                                   {f"t{i}": {"failed": 1 - v} for i, v in enumerate(prod)})
    assert decision.passed is passes and decision.checks["failed"].method == "tango"


@pytest.mark.parametrize("candidate,match", [
    ({"t0": {"passed": 1.0}}, "same task set"),
])
def test_gate_rejects_mismatched_tasks(candidate, match):
    with pytest.raises(ValueError, match=match):
        Gate().decide(candidate, {"t1": {"passed": 1.0}})


def test_gate_names_a_missing_metric():
    config = GateConfig(checks={"x": NonInferiorityCheck(metric="pased"), "y": RateLimitCheck(metric="q", max_rate=1)})
    tasks = {f"t{i}": {"passed": 1.0} for i in range(30)}
    decision = Gate(config).decide(tasks, tasks)
    assert not decision.passed and "pased" in decision.checks["x"].reason and decision.checks["x"].diff is None
    assert type(decision).model_validate_json(decision.model_dump_json()) == decision


def test_task_results_from_eval_episodes():
    def task(i: int, ambiguous: bool) -> Task:
        return Task(id=f"t{i}", family="bugfix", split="eval", instruction="fix it", files={}, hidden_tests={},
                    test_command="pytest", metadata=TaskMetadata(difficulty=1, ambiguous=ambiguous))

    def episode(i: int, won: bool, calls: int, invalid: int, asked: bool) -> Trajectory:
        return Trajectory(task_id=f"t{i}", family="bugfix", tokens=[], loss_mask=[], logprobs=[], versions=[],
                          prompt_len=0, status=Status.FINISHED, reward=float(won),
                          reward_parts={"all_passed_bonus": float(won)}, turns=1, tool_calls=calls,
                          invalid_tool_calls=invalid, asked_question=asked,
                          outcome=TestOutcome(tests_passed_frac=float(won), all_passed=won, timed_out=False,
                                              visible_tests_modified=False))

    got = task_results([task(0, False), task(1, True)], [episode(0, True, 4, 1, False), episode(1, False, 0, 0, True)])
    assert got == {"t0": {"passed": 1.0, "valid_tool_call_rate": 0.75, "asked_question": 0.0, "ambiguous": False},
                   "t1": {"passed": 0.0, "valid_tool_call_rate": None, "asked_question": 1.0, "ambiguous": True}}
    # Several samples of a task: the mean of each result; the valid share pools the samples' calls.
    samples = [episode(0, True, 4, 1, False), episode(0, False, 2, 2, True), episode(0, True, 2, 0, False),
               episode(0, False, 0, 0, False)]
    assert task_results([task(0, False)], samples) == {
        "t0": {"passed": 0.5, "valid_tool_call_rate": 5 / 8, "asked_question": 0.25, "ambiguous": False}}
    with pytest.raises(ValueError, match="not among the tasks"):
        task_results([task(0, False)], [episode(1, True, 1, 0, False)])


def test_sampled_battery_tells_a_coin_flip_shift_from_a_regression():
    # 16 tasks; the candidate moved three coin-flip tasks up and three down. Greedy sees six whole
    # discordant tasks, which 16 pairs cannot tell from a regression at a 0.2 margin; 8 samples per
    # task at temperature 1 see shares that moved by 1/8, and pass. A real regression still fails.
    production_greedy = [1.0] * 8 + [0.0] * 8
    candidate_greedy = [1.0] * 5 + [0.0] * 3 + [1.0] * 3 + [0.0] * 5
    assert not non_inferiority(candidate_greedy, production_greedy, margin=0.2, min_n=10).passed
    production = [0.875] * 5 + [0.5] * 3 + [0.5] * 3 + [0.125] * 5
    candidate = [0.875] * 5 + [0.375] * 3 + [0.625] * 3 + [0.125] * 5
    assert non_inferiority(candidate, production, margin=0.2, min_n=10).passed
    regressed = [0.5] * 5 + [0.125] * 3 + [0.25] * 3 + [0.0] * 5
    assert not non_inferiority(regressed, production, margin=0.2, min_n=10).passed


def test_rate_limit_on_shares_and_battery_sampling_needs_a_temperature():
    assert rate_limit([0.25] * 10, 0.3).passed and not rate_limit([0.5] * 10, 0.3).passed
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        rate_limit([2.0], 0.3)
    assert EvalBattery(samples=4, episode=EpisodeConfig(temperature=1.0)).samples == 4
    with pytest.raises(ValueError, match="temperature 0"):
        EvalBattery(samples=4)
