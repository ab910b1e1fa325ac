"""The demo's bootstrap cache, on a real registry (SQLite file, a tiny real MoE checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from flywheel.demo import _cached_bootstrap, _start_report, cache_refusal, outcome_line
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import CANDIDATE, PRODUCTION, Registry
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.bootstrap import BootstrapConfig
from flywheel.rl.train import TrainConfig
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


def test_the_summary_line_says_the_lift_with_its_interval_or_why_nothing_was_promoted():
    lift = {"before": 0.469, "after": 0.531, "diff": 0.0625, "ci": [0.01, 0.12], "tasks": 96, "gained": 9,
            "lost": 3, "significant": True}
    rollback = SimpleNamespace(cycle=1, decision="rollback", reason="no success metric improved significantly")
    line = outcome_line({"simulated_rl_lift": lift}, [rollback])
    assert "0.469 -> 0.531 (+0.062, 95% CI [+0.010, +0.120] over 96 paired tasks, 9 gained / 3 lost: significant)" \
        in line
    assert "promoted nothing in 1 cycle(s); the last: no success metric improved significantly" in line
    unpaired = outcome_line({"simulated_rl_lift": None, "pass_rate_bootstrap": 0.4,
                             "pass_rate_after_simulated_rl": 0.45}, [])
    assert "0.400 -> 0.450 (no paired start eval" in unpaired and "ran no cycle" in unpaired
