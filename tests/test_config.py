"""Every config file in the repo parses; overrides and errors behave."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from flywheel.config import ConfigError, load_config, parse_override, write_resolved
from flywheel.demo import DemoConfig
from flywheel.live.cycle import LiveConfig
from flywheel.live.gate import GateConfig
from flywheel.live.rewards import RewardConfig
from flywheel.live.server import DashboardConfig, ServeConfig
from flywheel.live.settings import LoopConfig
from flywheel.rl.bootstrap import BootstrapConfig
from flywheel.rl.distributed import DistTrainConfig
from flywheel.rl.train import TrainConfig
from flywheel.sim.scenario import ScenarioConfig
from flywheel.sim.users import Population
from flywheel.tinker.server import TinkerConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# Which model reads which file: a new config file must be added here, or this test fails.
MODELS = {
    "demo.toml": DemoConfig,
    "dist.toml": DistTrainConfig,
    "gate.toml": GateConfig,
    "live.toml": LiveConfig,
    "loop.toml": LoopConfig,
    "bootstrap.toml": BootstrapConfig,
    "population.toml": Population,
    "quick.toml": DemoConfig,
    "rewards.toml": RewardConfig,
    "rewards_naive_drop_invalid.toml": RewardConfig,
    "rewards_naive_edits_only.toml": RewardConfig,
    "scenario_drop_invalid.toml": ScenarioConfig,
    "scenario_edits_only.toml": ScenarioConfig,
    "scenario_hostile_hints.toml": ScenarioConfig,
    "serve.toml": ServeConfig,
    "tinker.toml": TinkerConfig,
    "train.toml": TrainConfig,
}


def test_every_config_file_parses():
    files = sorted(p.name for p in CONFIGS.glob("*.toml"))
    assert files, "no configs found"
    for name in files:
        assert name in MODELS, f"configs/{name} has no model in tests/test_config.py"
        load_config(MODELS[name], CONFIGS / name)


def test_overrides_are_toml_values():
    assert parse_override("pool.max_active=3") == (["pool", "max_active"], 3)
    assert parse_override("families=['bugfix']") == (["families"], ["bugfix"])
    assert parse_override("run_dir=runs/x") == (["run_dir"], "runs/x")
    config = load_config(DemoConfig, CONFIGS / "demo.toml", ["pool.max_active=3", "live.cycles=5"])
    assert config.pool.max_active == 3 and config.live.cycles == 5
    assert config.live.batch.min_completions == 96  # the file's value where no override says otherwise


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(DemoConfig, tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="cylces"):
        load_config(DemoConfig, None, ["live.cylces=3"])
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("no-equals-sign")


def test_train_refuses_a_learner_that_scores_at_another_temperature_than_was_sampled():
    with pytest.raises(ConfigError, match="set learner.temperature = orchestrator.episode.temperature"):
        load_config(TrainConfig, CONFIGS / "train.toml",
                    ["orchestrator.episode.temperature=0.7", "learner.temperature=1.0"])
    config = load_config(TrainConfig, CONFIGS / "train.toml",
                         ["orchestrator.episode.temperature=0.5", "learner.temperature=0.5"])
    assert config.learner.temperature == config.orchestrator.episode.temperature == 0.5


def test_train_refuses_moe_rl_settings_the_run_could_not_honour():
    with pytest.raises(ConfigError, match="orchestrator.episode.routed_experts = true"):
        load_config(TrainConfig, CONFIGS / "train.toml", ["learner.loss.routing_replay=true"])
    with pytest.raises(ConfigError, match="streams"):
        load_config(TrainConfig, CONFIGS / "train.toml", ["learner.loss.routing_replay=true",
                                                          "orchestrator.episode.routed_experts=true",
                                                          'engine.backend="vllm"'])
    on_vllm = load_config(TrainConfig, CONFIGS / "train.toml", ["weight_deltas=true", 'engine.backend="vllm"'])
    assert on_vllm.weight_deltas  # the vLLM engine sends the deltas to its servers' workers
    on_ray = load_config(TrainConfig, CONFIGS / "train.toml", ["weight_deltas=true", 'cluster.backend="ray"'])
    assert on_ray.weight_deltas
    config = load_config(TrainConfig, CONFIGS / "train.toml", ["learner.loss.routing_replay=true", "weight_deltas=true",
                                                               "orchestrator.episode.routed_experts=true"])
    assert config.learner.loss.routing_replay and config.weight_deltas


def test_resolved_config_is_written(tmp_path):
    config = load_config(DemoConfig, None, ["bootstrap.seed=4"])
    out = write_resolved(config, tmp_path / "run")
    assert DemoConfig.model_validate_json(out.read_text()) == config


def _sections(model: type[BaseModel], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type[BaseModel]]]:
    """(path, model) of `model` and of every table under it a `--set` can reach (nested config models)."""
    yield path, model
    for name, field in model.model_fields.items():
        # The model itself or `Model | None`; lists and dicts of models are not a `--set` table.
        options = get_args(field.annotation) if get_origin(field.annotation) in (Union, UnionType) else ()
        nested = [t for t in (field.annotation, *options) if isinstance(t, type) and issubclass(t, BaseModel)]
        for sub in nested[:1]:
            yield from _sections(sub, (*path, name))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_typo_in_any_section_of_any_config_file_is_an_error_naming_it(name):
    model = MODELS[name]
    sections = list(_sections(model))
    assert len(sections) > 1 or model in (RewardConfig, Population), f"{name}: no nested sections found"
    for path, _ in sections:
        typo = ".".join((*path, "max_actve"))
        with pytest.raises(ConfigError, match=re.escape(typo)):
            load_config(model, CONFIGS / name, [f"{typo}=3"])


def test_the_issue_s_example_typo_names_the_field():
    with pytest.raises(ConfigError, match=r"pool\.max_actve\n.*Extra inputs are not permitted"):
        load_config(TrainConfig, CONFIGS / "train.toml", ["pool.max_actve=3"])


def test_a_malformed_file_is_an_error_naming_it_also_when_another_config_includes_it(tmp_path):
    bad = tmp_path / "rewards.toml"
    bad.write_text("feedback_window_s = [\n")
    with pytest.raises(ConfigError, match=f"{re.escape(str(bad))} is not valid TOML"):
        load_config(RewardConfig, bad)
    with pytest.raises(ConfigError, match=f"{re.escape(str(bad))} is not valid TOML"):
        load_config(LiveConfig, None, [f"loop.rewards_file='{bad}'"])


def test_typos_in_tables_of_models_are_errors_at_load_too():
    # A scenario's reward_overrides are applied to its reward files when an arm runs: checked at load.
    with pytest.raises(ConfigError, match=r"reward_overrides on the naive rewards file.*\nfeedback_windw_s\n"):
        load_config(ScenarioConfig, CONFIGS / "scenario_drop_invalid.toml", ["reward_overrides.feedback_windw_s=3"])
    # A check of the gate is one of two models; the error names the key under either.
    with pytest.raises(ConfigError, match=r"checks\.pass_rate\.NonInferiorityCheck\.margn"):
        load_config(GateConfig, CONFIGS / "gate.toml", ["checks.pass_rate.margn=0.1"])


def test_serve_live_and_the_demo_read_one_set_of_live_loop_settings():
    # The shipped serve and live configs name one loop file: the dashboard and the cycle read the
    # same store and score completions the same way (flywheel/live/settings.py).
    serve = load_config(ServeConfig, CONFIGS / "serve.toml")
    live = load_config(LiveConfig, CONFIGS / "live.toml")
    assert serve.loop_file == live.loop_file == Path("configs/loop.toml")
    assert serve.loop == live.loop == load_config(LoopConfig, CONFIGS / "loop.toml")
    assert live.loop.rewards.feedback_window_s == 30.0 and live.loop.rewards_file == Path("configs/rewards.toml")
    # The demo holds one [loop] for its server and cycles, and refuses a second one.
    demo = load_config(DemoConfig, CONFIGS / "demo.toml")
    assert demo.loop.rewards.feedback_window_s == 5.0 and demo.loop.monitor.window_s == 60.0
    with pytest.raises(ConfigError, match="move live.loop to loop"):
        load_config(DemoConfig, CONFIGS / "demo.toml", ["live.loop.rewards.feedback_window_s=9"])


@pytest.mark.parametrize(("model", "key", "new"), [
    (ServeConfig, "run_dir", "loop.store.path"), (ServeConfig, "store_url", "loop.store.url"),
    (ServeConfig, "registry_root", "loop.store.registry_root"), (LiveConfig, "store_path", "loop.store.path"),
    (LiveConfig, "rewards.feedback_window_s", "loop.rewards"), (LiveConfig, "monitor.window_s", "loop.monitor"),
    (LiveConfig, "session_monitor.window_s", "loop.session_monitor"), (LiveConfig, "rewards_file", "loop.rewards_file"),
    (DashboardConfig, "rewards.feedback_window_s", "loop.rewards"),
    (DashboardConfig, "monitor.window_s", "loop.monitor"),
])
def test_a_config_that_sets_a_moved_key_is_told_its_new_place(tmp_path, model, key, new):
    # An old config file: the key it sets moved into the live loop's settings.
    old = tmp_path / "old.toml"
    table, _, name = key.rpartition(".")
    old.write_text((f"[{table}]\n" if table else "") + f"{name} = 1\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(key.split('.')[0])} moved to {re.escape(new)}"):
        load_config(model, old)
