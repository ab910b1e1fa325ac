"""The demo's bootstrap cache, on a real registry (SQLite file, a tiny real MoE checkpoint), and its
summary line, on the A/B's own comparisons."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from flywheel.agent.evaluate import gain_needed, paired_lift
from flywheel.demo import (
    _cached_bootstrap,
    _start_report,
    anatomy_line,
    cache_refusal,
    detectable_change,
    outcome_line,
)
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import CANDIDATE, PRODUCTION, Registry
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.bootstrap import BootstrapConfig
from flywheel.rl.train import TrainConfig, anatomy_totals
from flywheel.rl.train import eval_tasks as train_eval_tasks

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4,
                   experts_per_token=2, moe_intermediate_size=32)


def cached_run(root: Path, pass_rate: float) -> tuple[Path, Path]:
    """A run folder as a demo leaves it: version 0 with its eval metrics, a later version holding
    production and candidate, and the marker with the bootstrap config's key."""
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 8, vocab_size=300)
    model = build_model(TINY, tokenizer)
    registry_root = root / "registry"
    with Registry(registry_root) as registry:
        registry.register(model, tokenizer, metrics={"eval_pass_rate": pass_rate, "sft_tokens_per_s": 323.0,
                                                     "sft_seconds": 300.0}, aliases=[PRODUCTION])
        registry.register(model, tokenizer, parent=0, aliases=[PRODUCTION, CANDIDATE])
    marker = root / "bootstrap.key"
    marker.write_text("key-1")
    return registry_root, marker


def test_a_bootstrap_that_passes_something_is_reused_and_made_production_again(tmp_path: Path):
    registry_root, marker = cached_run(tmp_path, pass_rate=0.43)
    v0 = _cached_bootstrap(registry_root, marker, "key-1")
    assert v0 is not None and v0.version == 0
    with Registry(registry_root) as registry:
        assert registry.get(PRODUCTION).version == 0
        assert all(CANDIDATE not in c.aliases for c in registry.list())


def test_a_bootstrap_that_passes_nothing_is_not_reused_and_says_why(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]):
    registry_root, marker = cached_run(tmp_path, pass_rate=0.0)
    assert _cached_bootstrap(registry_root, marker, "key-1") is None
    said = capsys.readouterr().out
    assert "passed no held-out task" in said and "323 tokens/s" in said
    with Registry(registry_root) as registry:
        assert registry.get(PRODUCTION).version == 1  # left as it was: the caller bootstraps again


def test_another_config_or_no_marker_is_not_reused(tmp_path: Path):
    registry_root, marker = cached_run(tmp_path, pass_rate=0.43)
    assert _cached_bootstrap(registry_root, marker, "key-2") is None
    marker.unlink()
    assert _cached_bootstrap(registry_root, marker, "key-1") is None


def test_cache_refusal_names_the_reason_only_for_a_policy_that_passes_nothing():
    assert cache_refusal({"eval_pass_rate": 0.01}) is None
    reason = cache_refusal({"eval_pass_rate": 0.0, "sft_tokens_per_s": 6464.0, "sft_seconds": 300.0})
    assert reason is not None and "6,464 tokens/s for 300 s" in reason
    assert cache_refusal({}) is not None  # no eval recorded: nothing says it passes anything


def test_the_bootstraps_eval_is_the_start_report_only_for_the_same_tasks_and_episodes(tmp_path: Path):
    train_config = TrainConfig.model_validate({"families": ["bugfix"], "eval_tasks_per_family": 3,
                                               "orchestrator": {"episode": {"max_turns": 8,
                                                                            "max_tokens_per_turn": 256}}})
    boot = BootstrapConfig(families=["bugfix"], eval_tasks_per_family=3)
    path = tmp_path / "eval.json"
    assert _start_report(path, boot, train_config) == (None, f"{path} is missing")
    ids = [t.id for t in train_eval_tasks(train_config)]
    path.write_text(json.dumps({"pass_rate": 0.5, "per_task": {ids[0]: 1.0}}))
    assert "not an eval of simulated RL's 3 held-out tasks" in _start_report(path, boot, train_config)[1]
    path.write_text(json.dumps({"pass_rate": 1 / 3, "per_task": {ids[0]: 1.0, ids[1]: 0.0, ids[2]: 0.0}}))
    report, _ = _start_report(path, boot, train_config)
    assert report is not None and report["pass_rate"] == 1 / 3
    longer = train_config.model_copy(update={"orchestrator": train_config.orchestrator.model_copy(
        update={"episode": train_config.orchestrator.episode.model_copy(update={"max_turns": 12})})})
    assert "episodes differ" in _start_report(path, boot, longer)[1]


def cycle_report(number: int, decision: str, metrics: dict | None, reason: str = "") -> SimpleNamespace:
    """What the summary reads of a CycleReport: an A/B with real MetricComparisons, or none."""
    ab = SimpleNamespace(confidence=0.95, metrics=metrics) if metrics is not None else None
    return SimpleNamespace(cycle=number, decision=decision, reason=reason, production=1, production_after=1,
                           candidate=number + 1, ab=ab)


SIGNIFICANT = {"before": 0.469, "after": 0.531, "diff": 0.0625, "ci": [0.01, 0.12], "tasks": 96, "gained": 9,
               "lost": 3, "significant": True}
WITHIN_NOISE = {"before": 0.677, "after": 0.688, "diff": 0.0104, "ci": [-0.03, 0.05], "tasks": 96, "gained": 2,
                "lost": 1, "significant": False}


def test_the_summary_line_says_a_significant_lift_and_a_promotion_with_their_intervals():
    from flywheel.live.abtest import compare  # noqa: PLC0415  (the live stage loads torch: only here)

    better = compare("persistence", [1.0] * 10 + [0.0] * 30, [1.0] * 30 + [0.0] * 10, 0.95)
    line = outcome_line({"simulated_rl_lift": SIGNIFICANT}, [cycle_report(1, "promote", {"persistence": better})])
    assert ("simulated RL raised the held-out pass rate 0.469 -> 0.531 (+0.062, 95% CI [+0.010, +0.120], "
            "9 of 96 held-out tasks gained, 3 lost)") in line
    assert f"promoted v2 in cycle 1 on persistence +0.500 [{better.ci_low:+.3f}, {better.ci_high:+.3f}]" in line


def test_when_nothing_improved_significantly_the_line_says_what_the_run_showed_and_why():
    from flywheel.live.abtest import compare  # noqa: PLC0415

    persistence = compare("persistence", [1.0, 0.0] * 4, [1.0, 1.0, 0.0] * 3, 0.95)  # 8 / 9 edits kept or not
    reward = compare("reward", [0.1 * (i % 5) for i in range(40)], [0.1 * (i % 5) + 0.02 for i in range(41)], 0.95)
    reports = [cycle_report(1, "rejected", None, "gate: pass_rate worse"),
               cycle_report(2, "rollback", {"persistence": persistence, "reward": reward},
                            "no success metric (persistence, reward) improved significantly")]
    line = outcome_line({"simulated_rl_lift": WITHIN_NOISE}, reports)
    assert "left the held-out pass rate within noise, 0.677 -> 0.688 (+0.010, 95% CI [-0.030, +0.050]" in line
    assert "with 1 lost, 96 tasks show a gain only from 7 gained" in line
    assert "kept v1 through 2 cycle(s) (1 candidate(s) rejected by the gate): the last A/B (cycle 2)" in line
    assert f"persistence {persistence.diff:+.3f} [{persistence.ci_low:+.3f}, {persistence.ci_high:+.3f}] on 8/9" in line
    assert f"(detectable: ±{detectable_change(persistence):.2f})" in line and "on 40/41 answers" in line
    assert "rollback" not in line and line.count("\n") == 0
    worse = compare("latency", [1.0, 1.1] * 20, [2.0, 2.1] * 20, 0.95)
    line = outcome_line({"simulated_rl_lift": WITHIN_NOISE}, [cycle_report(1, "rollback", {"latency": worse})])
    assert "found the candidate significantly worse on latency +1.000" in line
    line = outcome_line({"simulated_rl_lift": None, "pass_rate_bootstrap": 0.4, "pass_rate_after_simulated_rl": 0.45},
                        [cycle_report(1, "rejected", None, "gate: pass_rate worse")])
    assert "0.400 -> 0.450 (no paired start eval" in line and "no candidate reached an A/B test" in line
    assert "ran no cycle" in outcome_line({"simulated_rl_lift": SIGNIFICANT}, [])


def test_gain_needed_is_where_the_paired_lift_turns_significant():
    for lost in (0, 1, 3):
        needed = gain_needed(lost, 96)
        assert needed is not None
        for gained, significant in ((needed - 1, False), (needed, True)):
            before = {f"t{i}": float(i < lost) for i in range(96)}
            after = {f"t{i}": float(lost <= i < lost + gained) for i in range(96)}
            assert paired_lift({"per_task": before}, {"per_task": after})["significant"] is significant
    assert gain_needed(0, 96) == 4 and gain_needed(0, 3) is None  # 3 tasks can never show a gain


def test_the_detectable_change_is_what_arms_of_that_size_find_significant_four_times_in_five():
    from flywheel.live.abtest import compare  # noqa: PLC0415

    rate = compare("persistence", [1.0, 0.0] * 20, [1.0, 0.0] * 20, 0.95)
    assert detectable_change(rate) == pytest.approx((1.96 + 0.8416) * (0.25 * 2 / 40) ** 0.5, rel=1e-3)  # 0.313
    assert detectable_change(rate, per_arm=160) == pytest.approx(detectable_change(rate) / 2)  # 4x the answers
    values = [float(i % 2) for i in range(400)]  # sd 0.5006 (n - 1)
    mean = compare("reward", values, values, 0.95)
    assert detectable_change(mean) == pytest.approx(2.8016 * 0.5006 * (2 / 400) ** 0.5, rel=1e-3)
    # by simulation: arms of 40 whose rates differ by that much come out "better" about 80% of the time
    rng = random.Random(0)
    shift = detectable_change(rate)
    hits = sum(compare("persistence", [float(rng.random() < 0.5 - shift / 2) for _ in range(40)],
                       [float(rng.random() < 0.5 + shift / 2) for _ in range(40)], 0.95).verdict == "better"
               for _ in range(400))
    assert 0.72 < hits / 400 < 0.88


def test_the_summary_sums_where_simulated_rls_time_went():
    steps = [{"time/step": 10.0, "time/wait_rollouts": 4.0, "time/learner_forward_backward": 5.0,
              "time/engine_decode": 6.0, "tokens/engine_decode": 24_000.0, "tokens/engine_prefill": 3_000.0,
              "time/engine_prefill": 1.0, "time/episode_grade": 30.0, "episodes_trained": 32, "batch_tokens": 20_000.0}
             ] * 3
    totals = anatomy_totals(steps)
    assert totals["time/step"] == 30.0 and totals["tokens/engine_decode"] == 72_000.0
    assert totals["episodes_per_min"] == 96 / 0.5 and totals["tokens_per_min"] == 60_000 / 0.5
    line = anatomy_line(totals)
    assert "96 episodes (192/min)" in line and "waiting for rollouts 12 s" in line and "Learner 15 s" in line
    assert "decode 72,000 tokens in 18 s (4,000/s)" in line and "grading 90 s" in line
