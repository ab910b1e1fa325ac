"""`flywheel train` end to end: the real CLI, engine, sandboxes, grading and Learner raise the reward.

The policy is a tiny model and the objective an easy one it can learn in a few steps: stop writing
broken tool calls. A short SFT teaches it to open its one turn with `<tool_call>` more often than
not (73 of 128 version-0 episodes over four runs; with the two openings trained 1:1 it was 10 of 32,
and step 1 once drew too few broken calls to tell) and then say a few words; the unclosed call is
answered as invalid and costs `invalid_call_penalty` (never dropped), while a plain-text turn costs
nothing. Every episode is the same task with its workspace untouched, so reward differences are
exactly those penalties: the reward can only rise if the policy emits fewer broken calls.
"""

from __future__ import annotations

import json

import pytest

from flywheel.agent.evaluate import summarize
from flywheel.cli import main
from flywheel.demo import held_out_curve_line
from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import Registry
from flywheel.model.tokenizer import train_tokenizer
from flywheel.rl.learner import weights_digest
from flywheel.rl.train import LOOP_STAGES, TrainConfig, eval_tasks, train
from tests.agent.test_evaluate import episode
from tests.rl.broken_call_policy import broken_call_policy


@pytest.mark.slow  # 18 s on the shared 2-core machine (load ~10)
def test_train_on_a_tiny_budget_raises_mean_reward(tmp_path):
    model, tokenizer = broken_call_policy(vocab_size=300)
    with Registry(tmp_path / "registry") as registry:  # start at v1: registry and policy versions differ
        registry.register(model, tokenizer, parent=None, note="an earlier version, never trained from")
        registry.register(model, tokenizer, parent=0, aliases=["production"], note="random tiny policy")
    config = tmp_path / "train.toml"
    config.write_text(f'''
registry_root = "{tmp_path / 'registry'}"
run_dir = "{tmp_path / 'run'}"
families = ["bugfix"]
train_tasks_per_family = 1
eval_tasks_per_family = 2
threads = 1

[orchestrator]
group_size = 8
groups_per_step = 2
max_staleness = 1
concurrency = 16
max_steps = 10
filter_zero_signal = false

[orchestrator.episode]
max_turns = 1
max_tokens_per_turn = 16

[learner]
lr = 0.03

[tracking]
tensorboard = true
''')
    assert main(["train", "--config", str(config)]) == 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 11))
    assert [s["policy_version"] for s in steps] == list(range(1, 11))  # steps from the start, not v1 + steps
    first = steps[0]["reward_mean"]  # all of step 1 was sampled by the start policy (staleness 0)
    last = sum(s["reward_mean"] for s in steps[-3:]) / 3
    trajectories = [json.loads(line)["trajectory"]
                    for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    untouched = max(t["reward"] for t in trajectories)
    assert first < untouched - 0.02  # the start really does emit broken calls, and pays for them
    assert last > first + 0.02, [round(s["reward_mean"], 3) for s in steps]
    assert max(s["staleness_max"] for s in steps) <= 1
    # Each step's anatomy: the loop's stages add up to its wall time, and the engine's prefill and
    # decode behind it are counted (tokens/s of each from the tokens and seconds).
    for s in steps:
        assert sum(s[f"time/{k}"] for k in LOOP_STAGES) == pytest.approx(s["time/step"], rel=1e-6)
        assert s["time/learner_forward_backward"] > 0 and s["time/learner_optimizer"] > 0
        assert s["time/engine_prefill"] + s["time/engine_decode"] + s["time/engine_idle"] > 0
    assert sum(s["tokens/engine_decode"] for s in steps) > 0 and sum(s["tokens/engine_prefill"] for s in steps) > 0
    with Registry(tmp_path / "registry") as registry:
        (_, _, trained) = registry.list()
        assert trained.version == 2 and trained.parent == 1 and trained.metrics["train_steps"] == 10
        trained_model, _ = registry.load(2)
    # Each policy's weights digest, on disk before the engines got it: one per version, all different
    # (the weights moved), the last one the registered weights'.
    policies = [json.loads(line) for line in (tmp_path / "run" / "policies.jsonl").read_text().splitlines()]
    assert [p["version"] for p in policies] == list(range(1, 11))
    assert len({p["digest"] for p in policies}) == 10 and policies[-1]["digest"] == weights_digest(trained_model)
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 10] and [e["policy_version"] for e in evals] == [0, 10]
    # The tracker got a copy of the same rows (flywheel/rl/tracking.py; read back from its event files).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    events = EventAccumulator(str(tmp_path / "run" / "tracking" / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("reward_mean")] == [
        (s["step"], round(s["reward_mean"], 5)) for s in steps]
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("eval/pass_rate")] == [
        (e["step"], round(e["pass_rate"], 5)) for e in evals]


def tiny_production(root):
    """A tiny untrained MoE policy, registered as production in a Registry at `root`; the model."""
    tokenizer = train_tokenizer(["def add(a, b):\n    return a + b\n"] * 8, vocab_size=300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                    num_experts=4, experts_per_token=2, moe_intermediate_size=32), tokenizer)
    with Registry(root) as registry:
        registry.register(model, tokenizer, parent=None, aliases=["production"])
    return model


def test_a_start_report_from_the_caller_is_the_eval_at_step_0_and_the_lift_is_paired(tmp_path):
    """The demo hands `train` the bootstrap's eval of the same held-out tasks: eval.jsonl starts at
    step 0 with it (not played again), and the summary's lift pairs it with the end's eval; the
    summary's curve holds every eval in step order, version 0 first, as the demo prints it."""
    model = tiny_production(tmp_path / "registry")
    config = TrainConfig.model_validate({
        "registry_root": tmp_path / "registry", "run_dir": tmp_path / "run", "families": ["bugfix"],
        "train_tasks_per_family": 1, "eval_tasks_per_family": 3, "threads": 1, "eval_at_start": False,
        "eval_every": 1, "weight_deltas": True,  # the local engine takes the weights as deltas (DeltaPush)
        "orchestrator": {"group_size": 2, "groups_per_step": 1, "max_steps": 2, "filter_zero_signal": False,
                         "episode": {"max_turns": 1, "max_tokens_per_turn": 8}}})
    ids = [t.id for t in eval_tasks(config)]
    start = summarize([episode(task, "bugfix", True) for task in ids])  # as if v0 had passed all three
    _, summary = train(config, log=lambda line: None, start_report=start)
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1, 2] and evals[0]["source"] == "start_report"
    full = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[0]["weight_update_bytes"] == full and 0 <= steps[1]["weight_update_bytes"] <= full  # then changes
    assert evals[0]["per_task"] == dict.fromkeys(ids, 1.0) and summary["pass_rate_start"] == 1.0
    lift = summary["lift"]
    assert lift["tasks"] == 3 and lift["before"] == 1.0 and lift["after"] == summary["pass_rate_end"]
    assert lift["lost"] == round(3 * (1 - summary["pass_rate_end"]))  # a random tiny policy passes ~none
    curve = summary["evals"]
    assert [e["step"] for e in curve] == [0, 1, 2] and curve[0]["pass_rate"] == 1.0 and "lift" not in curve[0]
    assert curve[-1]["lift"] == lift and all(low <= e["pass_rate"] <= high for e in curve
                                             for low, high in [e["pass_rate_ci"]])
    line = held_out_curve_line(curve)
    assert line.count(" -> ") == 2 and "v0 1.000 [" in line and f"step 2 {summary['pass_rate_end']:.3f}" in line


def test_the_curve_plays_a_prefix_of_the_held_out_set_and_the_lift_the_whole_set(tmp_path):
    """`curve_tasks_per_family`: the in-loop evals play the first tasks of each family only, every
    row of eval.jsonl (the start's and the end's too) is on those, and the summary's lift pairs the
    start and the end on the whole set."""
    tiny_production(tmp_path / "registry")
    config = TrainConfig.model_validate({
        "registry_root": tmp_path / "registry", "run_dir": tmp_path / "run", "families": ["bugfix", "implement"],
        "train_tasks_per_family": 1, "eval_tasks_per_family": 3, "curve_tasks_per_family": 1, "threads": 1,
        "eval_at_start": False, "eval_every": 1,
        "orchestrator": {"group_size": 2, "groups_per_step": 1, "max_steps": 2, "filter_zero_signal": False,
                         "episode": {"max_turns": 1, "max_tokens_per_turn": 8}}})
    whole, prefix = [t.id for t in eval_tasks(config)], [t.id for t in eval_tasks(config, 1)]
    assert len(whole) == 6 and len(prefix) == 2 and set(prefix) < set(whole)  # a prefix of each family's tasks
    start = summarize([episode(task, task.split("/")[0], task in prefix) for task in whole])  # v0: the prefix only
    _, summary = train(config, log=lambda line: None, start_report=start)
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1, 2] and all(sorted(e["per_task"]) == sorted(prefix) for e in evals)
    assert evals[0]["pass_rate"] == 1.0 and evals[0]["whole"] == {"tasks": 6, "pass_rate": 2 / 6,
                                                                  "pass_rate_ci": start["pass_rate_ci"]}
    assert "whole" not in evals[1] and evals[2]["whole"]["tasks"] == 6  # the in-loop eval played the prefix alone
    assert set(evals[0]["per_family"]) == {"bugfix", "implement"} and evals[0]["per_family"]["bugfix"]["episodes"] == 1
    assert summary["pass_rate_start"] == 2 / 6 and summary["lift"]["tasks"] == 6 and summary["lift"]["before"] == 2 / 6
    assert summary["evals"][-1]["lift"]["tasks"] == 2
    assert TrainConfig.model_validate({"eval_tasks_per_family": 2, "curve_tasks_per_family": 3}).curve_per_family == 2


@pytest.mark.slow  # two short runs of the tiny policy: ~20 s on 2 cores
def test_a_kl_term_to_the_start_policy_is_wired_and_its_reference_survives_a_resume(tmp_path):
    """`learner.loss.kl_coef > 0`: the Learner's reference is the run's start policy. The KL is 0 at
    step 1 (the policy is the start) and positive once the policy moved; a run resumed from its
    folder keeps the start as its reference (its first step's KL is not 0, as it would be against
    the resumed weights). Ray and torchrun runs are refused at config load with the reason."""
    model, tokenizer = broken_call_policy(vocab_size=300)  # its groups' rewards differ: the policy moves
    with Registry(tmp_path / "registry") as registry:
        registry.register(model, tokenizer, parent=None, aliases=["production"])
    settings = {
        "registry_root": tmp_path / "registry", "run_dir": tmp_path / "run", "families": ["bugfix"],
        "train_tasks_per_family": 1, "eval_tasks_per_family": 1, "threads": 1, "eval_at_start": False,
        "register_checkpoint": False, "learner": {"lr": 0.03, "loss": {"kl_coef": 0.5}},
        "orchestrator": {"group_size": 8, "groups_per_step": 2, "max_steps": 2, "filter_zero_signal": False,
                         "episode": {"max_turns": 1, "max_tokens_per_turn": 16}}}
    train(TrainConfig.model_validate(settings), log=lambda line: None)
    settings["orchestrator"]["max_steps"] = 3
    train(TrainConfig.model_validate(settings), log=lambda line: None)  # resumes at step 2
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert steps[1]["kl"] > 1e-6 and steps[2]["kl"] > 1e-6, [s["kl"] for s in steps]
    with pytest.raises(ValueError, match="kl_coef"):
        TrainConfig.model_validate({**settings, "cluster": {"backend": "ray"}})


def test_an_episode_longer_than_the_vllm_servers_context_is_refused_at_the_start(tmp_path):
    """An episode may grow to `orchestrator.episode.max_tokens`; vLLM refuses a request past its
    `max_model_len`. Caught with the config, not an hour into the run when a long episode reaches it."""
    settings = {"registry_root": tmp_path / "registry", "run_dir": tmp_path / "run",
                "orchestrator": {"episode": {"max_tokens": 4096}},
                "engine": {"backend": "vllm", "vllm": {"max_model_len": 2048}}}
    with pytest.raises(ValueError, match="exceeds engine.vllm.max_model_len 2048"):
        TrainConfig.model_validate(settings)
    settings["engine"]["vllm"]["max_model_len"] = 4096
    assert TrainConfig.model_validate(settings).engine.vllm.max_model_len == 4096
