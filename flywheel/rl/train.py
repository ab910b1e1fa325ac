"""Simulated RL from a registered checkpoint: the whole training loop in one screen.

    flywheel train [--config configs/train.toml] [--set orchestrator.max_staleness=2]

1. load the start checkpoint twice: one copy for the Engine (sampling), one for the Learner
2. the Orchestrator runs G episodes per training task in sandboxes, the Learner trains on every
   B complete groups, and the new weights go to the Engine while rollouts continue
3. every `eval_every` steps (and at the start and the end): held-out pass rate at temperature 0
4. register the result in the Registry (parent = the start version), with its eval metrics

Progress: one line per step (step, reward, pass rate, tokens/s, staleness); metrics.jsonl and
eval.jsonl in the run folder. A run folder that already holds a run is resumed, not overwritten.

Two kinds of version, two names. `vN` is a Registry version: the start checkpoint ("training v3")
and the registered result ("registered v7 (parent v3)"). The weights in between are counted by the
Learner as `policy_version` (logs: "policy 2"): learner steps taken since the start checkpoint,
which is policy 0. Every generated token carries the policy version that sampled it, and
staleness is the difference of two of them. A run's policy 5 is not registry v5.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.agent.evaluate import evaluate
from flywheel.env.families import FAMILIES, task_set
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.model.engine import Engine, EngineConfig
from flywheel.model.process_engine import start_engine
from flywheel.model.registry import Checkpoint, Registry
from flywheel.rl.learner import Learner, LearnerConfig
from flywheel.rl.orchestrator import Orchestrator, OrchestratorConfig


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint: str = "production"  # version number or alias to start from
    registry_root: Path = Path("runs/registry")
    run_dir: Path = Path("runs/train")
    families: list[str] = Field(default_factory=lambda: list(FAMILIES))
    train_tasks_per_family: int = 64
    train_difficulty: int = 1
    eval_tasks_per_family: int = 24  # the bootstrap's held-out set: same seed, same difficulty
    eval_difficulty: int = 1
    eval_every: int = 0  # steps between held-out evals (0: only at the start and the end)
    eval_at_start: bool = True  # off when the caller just evaluated the start checkpoint on the same tasks
    eval_temperature: float = 0.0
    time_budget_s: float | None = None  # stop stepping after this much wall time (the eval at the end still runs)
    seed: int = 0
    threads: int = 2
    register_checkpoint: bool = True
    alias: str | None = None  # e.g. "candidate"; production is moved only by the gate
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)

    @model_validator(mode="after")
    def _sampling_matches_learning(self) -> TrainConfig:
        sampled = self.orchestrator.episode.temperature
        if sampled > 0 and self.learner.temperature != sampled:
            raise ValueError(f"episodes sample at temperature {sampled} but the learner scores at "
                             f"{self.learner.temperature}: the behaviour logprobs would not be the learner's, and every "
                             "token would carry a spurious importance weight; set learner.temperature = "
                             "orchestrator.episode.temperature")
        return self


def train_tasks(config: TrainConfig):
    return task_set(config.families, "train", config.train_tasks_per_family, seed=config.seed + 100,
                    difficulty=config.train_difficulty)


def eval_tasks(config: TrainConfig):
    # The same held-out tasks the bootstrap reported on (seed + 1), so the numbers compare.
    return task_set(config.families, "eval", config.eval_tasks_per_family, seed=config.seed + 1,
                    difficulty=config.eval_difficulty)


def run_eval(config: TrainConfig, engine: Engine, tokenizer, pool: SandboxPool) -> dict[str, Any]:
    episode = config.orchestrator.episode.model_copy(update={"temperature": config.eval_temperature})
    report, _ = evaluate(eval_tasks(config), engine, tokenizer, pool, episode, progress=False)
    return report


def step_line(m: dict[str, Any]) -> str:
    # pass: every episode completed since the last step; trained: the batch's (dynamic sampling
    # leaves out all-pass groups, so it reads lower)
    return (f"step {m['step']:>3}  policy {m['policy_version']}  reward {m['reward_mean']:+.3f}  "
            f"pass {m['rollout_pass_rate']:.2f} (trained {m['pass_rate']:.2f})  "
            f"{m.get('tokens_per_s', 0.0):,.0f} tok/s  staleness ≤{m['staleness_max']}  "
            f"wait {m['wait_s']:.1f}s train {m['train_s']:.1f}s  filtered {m['filtered_groups']}")


def train(config: TrainConfig, log: Callable[[str], None] = print) -> tuple[Checkpoint | None, dict[str, Any]]:
    torch.set_num_threads(config.threads)
    start = time.perf_counter()
    config.run_dir.mkdir(parents=True, exist_ok=True)
    registry = Registry(config.registry_root)
    parent = registry.get(config.checkpoint)
    engine_model, tokenizer = registry.load(parent.version)
    learner_model, _ = registry.load(parent.version)
    learner = Learner(learner_model.train(), config.learner)  # policy 0: the start checkpoint's weights
    tasks = train_tasks(config)
    evals: list[dict[str, Any]] = []

    def record_eval(report: dict[str, Any], step: int) -> None:
        row = {"step": step, "policy_version": learner.version, "time_s": time.perf_counter() - start,
               **report}
        evals.append(row)
        with open(config.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        log(f"eval at step {step} (policy {learner.version}): pass rate {report['pass_rate']:.3f} "
            f"[{report['pass_rate_ci'][0]:.2f}, {report['pass_rate_ci'][1]:.2f}], "
            f"valid tool calls {report['valid_tool_call_rate']:.2f}, failed {report['failed_tool_call_rate']:.2f}")

    with start_engine(engine_model, config.engine, version=learner.version) as engine, SandboxPool(config.pool) as pool:
        orchestrator = Orchestrator(config.orchestrator, tasks, engine, learner, tokenizer, pool, config.run_dir,
                                    on_step=lambda m: log(step_line(m)))
        with orchestrator:
            if orchestrator.resume():
                log(f"resumed {config.run_dir} at step {orchestrator.step} (policy {learner.version})")
            elif config.eval_at_start:
                record_eval(run_eval(config, engine, tokenizer, pool), 0)
            log(f"training v{parent.version} on {len(tasks)} tasks: {config.orchestrator.mode}, "
                f"G={config.orchestrator.group_size} over {config.orchestrator.tasks_per_group} task(s), "
                f"B={config.orchestrator.groups_per_step}, "
                f"max_staleness={config.orchestrator.staleness_bound}")
            while orchestrator.step < config.orchestrator.max_steps:
                if config.time_budget_s is not None and time.perf_counter() - start > config.time_budget_s:
                    log(f"time budget of {config.time_budget_s:.0f} s reached at step {orchestrator.step}")
                    break
                orchestrator.train(orchestrator.step + 1)
                if config.eval_every and orchestrator.step % config.eval_every == 0 \
                        and orchestrator.step < config.orchestrator.max_steps:
                    record_eval(run_eval(config, engine, tokenizer, pool), orchestrator.step)
            orchestrator.close()  # in-flight episodes stop at a turn boundary, saved for a resume
            final = run_eval(config, engine, tokenizer, pool)
            record_eval(final, orchestrator.step)
    summary = {"steps": orchestrator.step, "policy_version": learner.version,
               "seconds": time.perf_counter() - start,
               "pass_rate_start": evals[0]["pass_rate"] if evals and evals[0]["step"] == 0 else float("nan"),
               "pass_rate_end": final["pass_rate"]}
    checkpoint = None
    if config.register_checkpoint and orchestrator.step > 0:
        metrics = {"eval_pass_rate": final["pass_rate"], "eval_valid_tool_call_rate": final["valid_tool_call_rate"],
                   "train_steps": float(orchestrator.step)}
        checkpoint = registry.register(learner.model.eval(), tokenizer, parent=parent.version, metrics=metrics,
                                       aliases=[config.alias] if config.alias else [],
                                       note=f"simulated RL ({config.orchestrator.mode}), {orchestrator.step} steps")
        log(f"registered v{checkpoint.version} (parent v{parent.version}) at {checkpoint.path}")
    registry.close()
    (config.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return checkpoint, summary
