"""Simulated RL from a registered checkpoint: the whole training loop in one screen.

    flywheel train [--config configs/train.toml] [--set orchestrator.max_staleness=2]

`train` sets up and runs the loop; `learning_step` is one step of it, in the order it happens:

1. tasks: the training task set; the start checkpoint loaded twice, one copy for the Engine
   (sampling), one for the Learner
2. rollouts: the Orchestrator runs G episodes per task in sandboxes while the loop learns (the
   built-in loop, or an external harness program: `[rollout.harness]`), and hands over a batch of
   B complete groups whose staleness is within the bound (`next_batch`)
3. advantages: group-relative, zero for episodes the sandbox or an abort spoiled
4. Learner step: one policy update on the batch (version v -> v + 1)
5. weights to the Engine, which swaps them in under the in-flight episodes; the Orchestrator is
   told the batch was consumed at v + 1, so new groups start
6. checkpoint: learner state + the Orchestrator's progress to run/state every `checkpoint_every`
   steps; the step's metrics to run/metrics.jsonl
7. eval every `eval_every` steps (and at the start and the end): held-out pass rate at temperature 0
8. register the result in the Registry (parent = the start version), with its eval metrics

Where the Learner, the Engine and the episodes run is `cluster.backend` (`flywheel.rl.cluster`):
in this process (default) or as Ray actors across nodes; the steps above are the same code.

Progress: one line per step (step, reward, pass rate, tokens/s, staleness); metrics.jsonl and
eval.jsonl in the run folder (`flywheel.rl.run_folder`). A run folder that already holds a run is
resumed, not overwritten.

Two kinds of version, two names. `vN` is a Registry version: the start checkpoint ("training v3")
and the registered result ("registered v7 (parent v3)"). The weights in between are counted by the
Learner as `policy_version` (logs: "policy 2"): learner steps taken since the start checkpoint,
which is policy 0. Every generated token carries the policy version that sampled it, and
staleness is the difference of two of them. A run's policy 5 is not registry v5.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flywheel.agent.evaluate import evaluate, paired_lift, passed
from flywheel.agent.trajectory import Status
from flywheel.env.families import FAMILIES, held_out_tasks, task_set
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.model.adapters import LoraConfig, merged, start_lora
from flywheel.model.engine import Engine, EngineConfig
from flywheel.model.registry import Checkpoint, Registry
from flywheel.rl.advantages import outcome_tied
from flywheel.rl.cluster import ClusterConfig, LearnerLost, LocalCluster, start_cluster
from flywheel.rl.distributed import DistConfig, follow_training, init_distributed, leading
from flywheel.rl.harness.program import HarnessProgram, harness_runner
from flywheel.rl.learner import Learner, LearnerConfig
from flywheel.rl.lora import LoraLearner
from flywheel.rl.orchestrator import Batch, EpisodeRunner, GroupOutcome, Orchestrator, OrchestratorConfig
from flywheel.rl.run_folder import RunFolder
from flywheel.rl.tracking import Tracker, TrackingConfig, eval_table
from flywheel.stats import wilson_interval
from flywheel.timing import cpu_seconds, timed


class RolloutConfig(BaseModel):
    """Who plays the training episodes. No `[rollout.harness]` (or `harness = "builtin"`): flywheel's
    own loop (flywheel/agent/episode.py). A harness: that program, unmodified, against a per-episode
    OpenAI endpoint that records the exact tokens (flywheel/rl/harness/), with the same limits
    (`orchestrator.episode`), admission, staleness bound and weight swaps; `harness = "mini-swe-agent"`
    is short for `[rollout.harness] preset = "mini-swe-agent"`. A harness costs a program start per
    episode (6 s of CPU for litellm's imports, measured) and a process per command; the held-out
    evals stay the built-in loop's, so they compare with every other run's."""

    model_config = ConfigDict(extra="forbid")
    harness: HarnessProgram | None = None

    @field_validator("harness", mode="before")
    @classmethod
    def _named(cls, value: Any) -> Any:
        if value == "builtin":
            return None
        return {"preset": value} if isinstance(value, str) else value


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint: str = "production"  # version number or alias to start from
    registry_root: Path = Path("runs/registry")
    run_dir: Path = Path("runs/train")
    families: list[str] = Field(default_factory=lambda: list(FAMILIES))
    train_tasks_per_family: int = 64
    train_difficulty: int = 1
    eval_tasks_per_family: int = 24  # the bootstrap's held-out set (`held_out_tasks`): same size, same difficulty
    eval_difficulty: int = 1
    eval_every: int = 0  # steps between held-out evals (0: only at the start and the end)
    # The curve: the evals every `eval_every` steps play only the first this many of those tasks a
    # family (a prefix of the held-out set), and eval.jsonl and the summary's curve show every eval,
    # the start's and the end's too, on that prefix; the start-to-end `lift` is on the whole set.
    # A large set narrows the lift's paired interval at the cost of two evals, not of every point.
    # None (or not fewer than eval_tasks_per_family): every eval plays the whole set.
    curve_tasks_per_family: int | None = Field(default=None, ge=1)
    eval_at_start: bool = True  # off when the caller just evaluated the start checkpoint on the same tasks
    eval_temperature: float = 0.0
    # Stop stepping after this much wall time of training: the evals (`eval_every`'s and the end's)
    # run outside it, so a curve of held-out points costs the run wall time, not learner steps.
    time_budget_s: float | None = None
    # Stop stepping after this many CPU seconds of the run's processes (`flywheel.timing.cpu_seconds`:
    # this one, the engine's, the sandboxes'), evals included. A budget that other jobs on a shared
    # machine do not shrink, as they shrink what `time_budget_s` buys; bench/learning.py compares
    # runs by it. metrics.jsonl's `cpu_s` is each step's reading.
    cpu_budget_s: float | None = Field(default=None, gt=0)
    # Steps between copies of the policy's weights in run_dir/policies/step-NNNNN.pt (0: none): a
    # run's learning curve evaluated afterwards (bench/learning.py), without evals that stop it.
    save_policy_every: int = Field(default=0, ge=0)
    seed: int = 0
    threads: int = 2
    register_checkpoint: bool = True
    alias: str | None = None  # e.g. "candidate"; production is moved only by the gate
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)  # local (default) or Ray actors across nodes
    # The Learner sharded over the processes of `torchrun -m flywheel train` / `flywheel train --nproc N`
    # (flywheel/rl/distributed.py): rank 0 runs the loop, every rank trains on its shard. None: one process.
    dist: DistConfig | None = None
    # Copies of metrics.jsonl / eval.jsonl to TensorBoard, W&B, MLflow (flywheel/rl/tracking.py); all off by default.
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    # Train a LoRA adapter of the start checkpoint instead of all its weights (a pretrained model:
    # flywheel/model/adapters.py, flywheel/rl/lora.py); the result is registered as an adapter version
    # on the full one. Starting from an adapter version continues its adapter. None: full weights.
    lora: LoraConfig | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the weights in memory (learner and engine)
    # Push only the weights that changed since the engine's last update (`flywheel.model.weight_delta`):
    # bit-identical results, fewer bytes copied and sent where most weights keep their bits between steps
    # (bf16 at a pretrained model's learning rate: 5.7% of the bytes, bench/engine.py --weight-deltas); in float32
    # AdamW moves every weight and the delta is a full push plus the cost of comparing, which on one host exceeds the
    # copy it saves (docs/moe-rl.md). Keeps a copy of the last weights sent (on the Ray driver: it fetches each
    # update once and sends the changes to every engine through the store; vLLM's workers apply a delta file to a
    # copy they keep, flywheel/model/vllm_worker.py).
    weight_deltas: bool = False

    @property
    def curve_per_family(self) -> int:
        """The curve's tasks a family: `curve_tasks_per_family`, at most the whole set's."""
        return min(self.curve_tasks_per_family or self.eval_tasks_per_family, self.eval_tasks_per_family)

    @model_validator(mode="after")
    def _sampling_matches_learning(self) -> TrainConfig:
        if self.rollout.harness is not None and self.cluster.backend != "local":
            raise ValueError("[rollout.harness] runs its programs on this machine: set "
                             "cluster.backend = 'local' (Ray rollout workers play the built-in loop only)")
        sampled = self.orchestrator.episode.temperature
        if sampled > 0 and self.learner.temperature != sampled:
            raise ValueError(f"episodes sample at temperature {sampled} but the learner scores at "
                             f"{self.learner.temperature}: the behaviour logprobs would not be the learner's, and "
                             "every "
                             "token would carry a spurious importance weight; set learner.temperature = "
                             "orchestrator.episode.temperature")
        if self.learner.loss.kl_coef > 0 and (self.cluster.backend != "local" or self.dist is not None):
            raise ValueError("learner.loss.kl_coef > 0 (a KL term to the run's start policy) is wired for the local "
                             "Learner and LoRA; the Ray learner actor and the torchrun ranks hold no reference "
                             "model: set cluster.backend = 'local' without [dist], or learner.loss.kl_coef = 0")
        if self.learner.loss.routing_replay and not self.orchestrator.episode.routed_experts:
            raise ValueError("learner.loss.routing_replay replays the experts the engine chose: set "
                             "orchestrator.episode.routed_experts = true so that episodes record them")
        if self.learner.loss.routing_replay and self.engine.backend == "vllm":
            raise ValueError("learner.loss.routing_replay needs the local engine's routing record: the installed "
                             "vLLM returns routed experts only in non-streamed completions (flywheel streams) and "
                             "only from a server its CPU build cannot start (docs/moe-rl.md); set "
                             "engine.backend = 'local' or turn routing replay off")
        episode_tokens = self.orchestrator.episode.max_tokens
        if self.engine.backend == "vllm" and episode_tokens > self.engine.vllm.max_model_len:
            raise ValueError(f"orchestrator.episode.max_tokens {episode_tokens} (an episode's whole context) exceeds "
                             f"engine.vllm.max_model_len {self.engine.vllm.max_model_len}: a long episode's request "
                             "would be refused mid-run; raise max_model_len or lower the episode's max_tokens")
        if self.lora is not None and (self.dist is not None or self.cluster.backend != "local"):
            raise ValueError("lora trains in this process: remove [dist] and set cluster.backend = \"local\" (a "
                             "LoRA adapter of a small pretrained model fits one process)")
        if self.dist is not None and self.cluster.backend != "local":
            raise ValueError("dist (the torchrun-sharded Learner) runs with cluster.backend=\"local\": rank 0 "
                             "plays the episodes; remove [dist] or set cluster.backend=\"local\"")
        return self


def train_tasks(config: TrainConfig):
    return task_set(config.families, "train", config.train_tasks_per_family, seed=config.seed + 100,
                    difficulty=config.train_difficulty)


def eval_tasks(config: TrainConfig, per_family: int | None = None):
    """The held-out tasks (`per_family` of them a family: a prefix of the whole set; None: the whole set).
    The same the bootstrap reported on, whatever either run's seed, so the numbers compare."""
    return held_out_tasks(config.families, per_family or config.eval_tasks_per_family, config.eval_difficulty)


def run_eval(config: TrainConfig, engine: Engine, tokenizer, pool: SandboxPool,
             per_family: int | None = None) -> dict[str, Any]:
    episode = config.orchestrator.episode.model_copy(update={"temperature": config.eval_temperature})
    report, _ = evaluate(eval_tasks(config, per_family), engine, tokenizer, pool, episode, progress=False)
    return report


def on_tasks(report: dict[str, Any], tasks: Sequence[Any]) -> dict[str, Any]:
    """An eval `report` of a superset of `tasks` (one episode a task), restricted to `tasks`: the pass
    rates (whole, per family, per task) recomputed from its per-task results, the whole eval's kept
    under `whole` (tasks, pass rate, interval). Figures per-task results cannot restrict (tool calls,
    turns, rewards) stay the whole eval's."""
    per_task = report.get("per_task") or {}
    missing = [t.id for t in tasks if t.id not in per_task]
    if missing:
        raise ValueError(f"the eval report has no result for {len(missing)} of the tasks, e.g. {missing[:3]}: "
                         "restrict a report to tasks it played")

    def rates(chosen: Sequence[Any]) -> dict[str, Any]:
        wins = sum(per_task[t.id] for t in chosen)
        return {"episodes": len(chosen), "pass_rate": wins / len(chosen),
                "pass_rate_ci": list(wilson_interval(wins, len(chosen)))}

    families: dict[str, list[Any]] = {}
    for t in tasks:
        families.setdefault(t.family, []).append(t)
    return {**report, **rates(tasks), "per_family": {f: rates(ts) for f, ts in sorted(families.items())},
            "per_task": {t.id: per_task[t.id] for t in tasks},
            "whole": {"tasks": len(per_task), "pass_rate": report["pass_rate"], "pass_rate_ci": report["pass_rate_ci"]}}


def step_line(m: dict[str, Any]) -> str:
    # pass: every episode completed since the last step; trained: the batch's (dynamic sampling
    # leaves out all-pass groups, so it reads lower)
    return (f"step {m['step']:>3}  policy {m['policy_version']}  reward {m['reward_mean']:+.3f}  "
            f"pass {m['rollout_pass_rate']:.2f} (trained {m['pass_rate']:.2f})  "
            f"{m.get('tokens_per_s', 0.0):,.0f} tok/s  staleness ≤{m['staleness_max']:.0f}  "
            f"wait {m['wait_s']:.1f}s train {m['train_s']:.1f}s  filtered {m['filtered_groups']}  "
            f"frontier {m.get('frontier_share', float('nan')):.2f}")


def learning_step(config: OrchestratorConfig, orchestrator: Orchestrator, learner: Learner, engine: Engine,
                  run: RunFolder, cpu_s: Callable[[], float] | None = None) -> dict[str, Any]:
    """One step of the loop: a batch of rollouts, its advantages, a Learner step, the new weights to
    the Engine, a checkpoint. Returns the step's metrics (also appended to run/metrics.jsonl), with
    its anatomy (`step_anatomy`): where the wall time behind the step went, and `cpu_s`'s reading
    (the run's CPU seconds so far) where given."""
    seconds: dict[str, float] = {}
    with timed(seconds, "step_s"):
        with timed(seconds, "wait_s"):
            batch = orchestrator.next_batch()  # blocks until B complete groups within the staleness bound
        trajectories = batch.trajectories()
        advantages = config.advantages.for_trajectories(trajectories)
        # A sandbox failure or an abort is not the policy's doing: recorded, but no gradient.
        advantages = [a if t.status not in (Status.SANDBOX_ERROR, Status.ABORTED) else 0.0
                      for a, t in zip(advantages, trajectories, strict=True)]

        with timed(seconds, "train_s"):
            metrics = dict(learner.train_step(trajectories, advantages))  # its staleness_max: the batch's

        if (digest := metrics.pop("policy_digest", None)) is not None:  # on disk before any engine holds them
            run.append("policies.jsonl", {"version": learner.version, "digest": int(digest)})  # rl/audit.py
        with timed(seconds, "weight_update_s"):
            engine.update_weights(learner.weights(), learner.version, timeout_s=config.weight_update_timeout_s)
        if (sent := getattr(engine, "last_update_bytes", None)) is not None:  # weight_deltas: what the push carried
            metrics["weight_update_bytes"] = float(sent)
        if (restarts := getattr(engine, "restarts", None)) is not None:  # engine processes or vLLM servers started
            metrics["engine_restarts"], metrics["engine_resent_requests"] = restarts, engine.resent  # again, this life
            if restart_s := getattr(engine, "stats", {}).get("restart_s"):  # vLLM: from a death to serving again
                metrics["engine_restart_s_mean"] = sum(restart_s) / len(restart_s)
        orchestrator.consumed(batch.group_ids, learner.version)

        counts = orchestrator.counts()
        metrics.update(batch_metrics(batch, counts))
        due = orchestrator.step % config.checkpoint_every == 0
        with timed(seconds, "checkpoint_s"):  # the state copied, the previous save waited for; written meanwhile
            state = snapshot(learner) if due else None
            run.wait_for_state()
    if replaced := orchestrator.replacements():  # Ray: dead workers and engines replaced during the step
        metrics["replacements"] = replaced
    metrics.update({"step": orchestrator.step, "policy_version": learner.version, **seconds,
                    **step_anatomy(batch, metrics, seconds), "time": time.time()})
    if cpu_s is not None:
        metrics["cpu_s"] = cpu_s()
    if state is not None:
        # written while the next step runs, the metrics line after it (the previous save landed first)
        run.save_state_later(state, orchestrator.progress(counts), then=("metrics.jsonl", metrics))
    else:
        run.append("metrics.jsonl", metrics)  # after the previous save's line: the lines stay in step order
    return metrics


# The stages of a step's anatomy, in metrics.jsonl as `time/<stage>` (seconds) and `tokens/<stage>`.
# The training loop's own, which add up to `time/step` (its wall time): waiting for complete groups,
# waiting for a group the staleness bound holds the step for, the Learner's phases, the weight push,
# the checkpoint, and the rest (advantages, bookkeeping). The rollouts': the engine's busy and idle
# seconds between two batches (a wall-time split of its one loop), and the episodes' tool calls,
# grading and sandbox creation, summed over the episodes finished in that time (episode-seconds).
LOOP_STAGES = ("wait_rollouts", "wait_staleness", "learner_forward_backward", "learner_optimizer", "learner_other",
               "weight_push", "checkpoint", "loop_other")
ROLLOUT_STAGES = ("engine_prefill", "engine_decode", "engine_swap", "engine_idle", "episode_tools", "episode_grade",
                  "episode_sandbox", "episode_generate")


def step_anatomy(batch: Batch, learner_metrics: Mapping[str, Any], seconds: Mapping[str, float]) -> dict[str, float]:
    """Where the wall time behind a step went (`LOOP_STAGES`, `ROLLOUT_STAGES`), from the loop's
    `timed` seconds, the Learner's phases and the batch's rollout seconds (`Batch.seconds`); engine
    stages only where the engine counts them (not vLLM's or Ray's)."""
    rollouts = batch.seconds
    learner_fb = learner_metrics.get("learner_forward_backward_s", 0.0) + learner_metrics.get("learner_proximal_s", 0.0)
    learner_opt = learner_metrics.get("learner_optimizer_s", 0.0)
    loop = {"wait_rollouts": rollouts.get("wait_rollouts_s", 0.0),
            "wait_staleness": rollouts.get("wait_staleness_s", 0.0),
            "learner_forward_backward": learner_fb, "learner_optimizer": learner_opt,
            "learner_other": max(0.0, seconds["train_s"] - learner_fb - learner_opt),
            "weight_push": seconds["weight_update_s"], "checkpoint": seconds["checkpoint_s"]}
    loop["loop_other"] = max(0.0, seconds["step_s"] - sum(loop.values()))
    out = {f"time/{k}": v for k, v in loop.items()}
    out["time/step"] = seconds["step_s"]
    for stage in ROLLOUT_STAGES:
        if f"{stage}_s" in rollouts:
            out[f"time/{stage}"] = rollouts[f"{stage}_s"]
    if "engine_decode_tokens" in rollouts:
        out["tokens/engine_prefill"] = rollouts["engine_prefill_tokens"]
        out["tokens/engine_decode"] = rollouts["engine_decode_tokens"]
        out["engine_decode_steps"] = rollouts["engine_decode_steps"]  # decode_tokens / steps: the mean batch
    return out


def anatomy_totals(steps: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The steps' anatomy summed (`time/<stage>` seconds, `tokens/<stage>`), with the episodes and
    tokens they trained and those per minute of the steps' wall time (`time/step`): the figures
    that a smaller batch cannot inflate, as it would steps per minute."""
    totals = {k: sum(float(m.get(k, 0.0)) for m in steps)
              for k in dict.fromkeys(k for m in steps for k in m if k.startswith(("time/", "tokens/")))}
    episodes = sum(m.get("episodes_trained", 0) for m in steps)
    tokens = sum(m.get("batch_tokens", 0.0) for m in steps)
    minutes = totals.get("time/step", 0.0) / 60
    return {**totals, "episodes_trained": float(episodes), "tokens_trained": tokens,
            "episodes_per_min": episodes / minutes if minutes else 0.0,
            "tokens_per_min": tokens / minutes if minutes else 0.0}


def save_policy(run: RunFolder, learner: Any, step: int) -> Path:
    """The policy's weights after `step` as run/policies/step-NNNNN.pt (`TrainConfig.save_policy_every`)."""
    path = run.root / "policies" / f"step-{step:05d}.pt"
    path.parent.mkdir(exist_ok=True)
    torch.save(learner.weights(), path)
    return path


def snapshot(learner: Any) -> Callable[[], dict[str, Any]]:
    """The learner's state as of now, read when called: its `snapshot()` (the Ray learner's is
    fetched from the actor then), or for a learner without one, its `state()` taken now."""
    if hasattr(learner, "snapshot"):
        return learner.snapshot()
    state = learner.state()
    return lambda: state


class FleetLog:
    """A Ray run's fleet.jsonl: after each step, the sandbox fleet per node (`cluster.stats()`, one
    round trip to every worker and engine) asked for on a thread of its own, so that the loop and
    the learner do not wait for it (it cost 27 ms of a 590 ms step on 2 cores); rows land in step
    order. `close` waits for the last one. A local run has no fleet and no thread."""

    def __init__(self, cluster: Any, run: RunFolder, log: Callable[[str], None]):
        self._cluster, self._run, self._log = cluster, run, log
        ray = not isinstance(cluster, LocalCluster)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="fleet-stats") if ray else None

    def after_step(self, step: int) -> None:
        if self._executor is not None:
            self._executor.submit(self._write, step)

    def _write(self, step: int) -> None:
        try:
            if fleet := self._cluster.stats():  # live sandboxes, queue wait, creation rate per node
                self._run.append("fleet.jsonl", {"step": step, **fleet})
        except Exception as exc:  # noqa: BLE001 - a missing fleet row must not stop training
            self._log(f"fleet stats after step {step} failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def wait_quietly(run: RunFolder) -> None:
    """`run.wait_for_state()` on a path that is already raising: that error is the one to report."""
    try:
        run.wait_for_state()
    except Exception:  # noqa: BLE001, S110 - the save's failure is the learner's, raised already
        pass


def batch_metrics(batch: Batch, counts: dict[str, int]) -> dict[str, Any]:
    """What the batch and the rollouts since the previous one say about the policy, and the draw
    (`draw_metrics`)."""
    trajectories = batch.trajectories()
    outcomes = [passed(t) for t in trajectories]
    tied = sum(outcome_tied([passed(t) for t in g.trajectories], [t.reward for t in g.trajectories])
               for g in batch.groups)
    return {
        **draw_metrics(batch.outcomes),
        "outcome_tied_groups": tied,
        "reward_mean": sum(t.reward for t in trajectories) / len(trajectories),
        "pass_rate": sum(outcomes) / len(outcomes),
        "failed_tool_calls": sum(t.failed_tool_calls for t in trajectories) / len(trajectories),  # per episode
        "rollout_episodes": batch.rollout_episodes,
        "rollout_pass_rate": batch.rollout_passed / batch.rollout_episodes if batch.rollout_episodes else float("nan"),
        "episodes_trained": len(trajectories),
        "groups": batch.group_ids,  # what this step trained (flywheel/rl/audit.py reads it)
        **counts,
    }


def draw_metrics(outcomes: Sequence[GroupOutcome]) -> dict[str, Any]:
    """The groups completed since the previous step (`Batch.outcomes`): each group's tasks, family,
    difficulty, passes, reward mean and spread, the pass rate estimated for its tasks when it was
    drawn and whether dynamic sampling dropped it and why (`draw`); the share of them on the frontier
    (some episodes passed, some failed) and with any signal; the filtered ones by reason; and
    `draw_estimate` beside `rollout_pass_rate`: the pass rate the run expected of the tasks it drew
    (from the episodes finished before) and the one they had. A training reward that falls with
    the estimate is a harder draw; one that falls below it, a policy doing worse than before."""
    n = len(outcomes)
    nan = float("nan")
    estimates = [o.estimate for o in outcomes if o.estimate == o.estimate]
    filtered = Counter(o.filtered for o in outcomes if o.filtered)
    return {"groups_completed": n,
            "frontier_share": sum(o.mixed for o in outcomes) / n if n else nan,
            "signal_share": sum(o.signal for o in outcomes) / n if n else nan,
            "filtered_all_passed": filtered["all passed"], "filtered_all_failed": filtered["all failed"],
            "filtered_equal_rewards": filtered["equal rewards"],
            "draw_estimate": sum(estimates) / len(estimates) if estimates else nan,
            "draw": [{"group": o.id, "family": o.family, "tasks": list(o.tasks), "difficulty": o.difficulty,
                      "version": o.start_version, "passed": o.passed, "episodes": o.episodes,
                      "reward_mean": round(o.reward_mean, 4), "reward_spread": round(o.reward_spread, 4),
                      "estimate": round(o.estimate, 4) if o.estimate == o.estimate else None,
                      "filtered": o.filtered} for o in outcomes]}


def learn(config: OrchestratorConfig, orchestrator: Orchestrator, learner: Learner, engine: Engine, run: RunFolder,
          until: int | None = None, on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """`learning_step` until `until` steps in total (default `config.max_steps`; resumed steps count)."""
    goal = config.max_steps if until is None else until
    history = []
    while orchestrator.step < goal:
        history.append(learning_step(config, orchestrator, learner, engine, run))
        if on_step is not None:
            on_step(history[-1])
    run.wait_for_state()
    return history


def resume(config: OrchestratorConfig, orchestrator: Orchestrator, learner: Learner, engine: Engine,
           run: RunFolder) -> bool:
    """Continue the run in `run` if it holds one: the learner and the engine get the checkpointed
    weights, the Orchestrator its groups and episodes. Returns whether there was a run."""
    saved, progress = run.load_state(), None
    if saved is not None:
        run.complete_record()  # the checkpointed step's metrics line, if the crash came before its append
        learner_state, progress = saved
        learner.load_state(learner_state)
        engine.update_weights(learner.weights(), learner.version, timeout_s=config.weight_update_timeout_s)
    return orchestrator.resume(progress)


def episode_runner(config: TrainConfig, cluster: Any, engine: Engine, tokenizer,
                   pool: SandboxPool) -> AbstractContextManager[EpisodeRunner | None]:
    """Who plays the episodes: the cluster's runner (None: the Orchestrator's own threads), or the
    `[rollout.harness]` program's, each episode's files in run_dir/harness."""
    if config.rollout.harness is None:
        return nullcontext(cluster.runner(engine))
    return harness_runner(config.rollout.harness, engine, tokenizer, pool, config.orchestrator.episode,
                          config.run_dir / "harness")


def train(config: TrainConfig, log: Callable[[str], None] = print,
          start_report: Mapping[str, Any] | None = None) -> tuple[Checkpoint | None, dict[str, Any]]:
    """`train_once`, restarted from the run's last checkpoint when a Ray learner actor dies
    (`cluster.learner_restarts` times): the resume path of a killed local run.

    Under torchrun with `dist` set, ranks > 0 only follow rank 0's Learner calls (flywheel/rl/distributed.py)
    and return (None, {})."""
    if config.dist is not None:
        init_distributed(config.dist)
        if torch.distributed.get_rank() != 0:
            torch.set_num_threads(config.threads)
            follow_training(config.registry_root, config.learner, config.dist)
            return None, {}
    for restart in range(config.cluster.learner_restarts + 1):
        try:
            return train_once(config, log, start_report)
        except LearnerLost as exc:
            if restart == config.cluster.learner_restarts:
                raise
            log(f"{exc}: restarting from {config.run_dir} ({restart + 1} of {config.cluster.learner_restarts})")
    raise AssertionError("unreachable")


def learner_for(config: TrainConfig, cluster: Any, model: Any, start: int) -> AbstractContextManager[Any]:
    """The Learner: rank 0's `LeaderLearner` over the torchrun ranks when `dist` is set (Registry
    version `start` is what the other ranks load), a `LoraLearner` over an adapter, else the cluster's.
    With `learner.loss.kl_coef > 0` (local and LoRA only: TrainConfig refuses the others) the KL
    term's reference is the run's start policy, frozen: a copy of `model` made before a resume
    loads the run's state into it (for LoRA, the start's weights with its adapter merged)."""
    ref = reference_policy(model, lora=config.lora is not None) if config.learner.loss.kl_coef > 0 else None
    if config.lora is not None:
        return nullcontext(LoraLearner(model, config.learner, ref_model=ref))
    if config.dist is None:
        return cluster.learner(model, config.learner, threads=config.threads, ref_model=ref)
    return leading(model, start, config.learner, config.dist, config.run_dir / "learner")


def reference_policy(model: Any, lora: bool) -> Any:
    """A frozen copy of `model` as it is now (with a LoRA adapter: its merged weights)."""
    ref = merged(model) if lora else copy.deepcopy(model)
    for param in ref.parameters():
        param.requires_grad_(False)
    return ref.eval()


def train_once(config: TrainConfig, log: Callable[[str], None] = print,
               start_report: Mapping[str, Any] | None = None) -> tuple[Checkpoint | None, dict[str, Any]]:
    """The RL loop (module docstring). `start_report`: the start checkpoint's held-out eval that the
    caller already played on these eval tasks (the demo passes the bootstrap's); it is recorded as the
    eval at step 0 instead of being played again, so every run's eval.jsonl starts at its start.
    Episodes of a `[rollout.harness]` are its program's; the held-out evals stay the built-in loop's,
    so they compare with every other run's."""
    torch.set_num_threads(config.threads)
    start, cpu_start = time.perf_counter(), cpu_seconds()
    config.run_dir.mkdir(parents=True, exist_ok=True)
    run = RunFolder(config.run_dir)
    registry = Registry(config.registry_root)
    parent = registry.get(config.checkpoint)
    engine_model, tokenizer = registry.load(parent.version, dtype=config.dtype)
    if config.lora is None:
        learner_model, _ = registry.load(parent.version, dtype=config.dtype)
        base = None
    else:  # the adapter trains; the result is an adapter version on `base`
        learner_model, _, base_checkpoint = start_lora(registry, parent.version, config.lora, dtype=config.dtype)
        base = base_checkpoint.version
    tasks = train_tasks(config)
    orch_config = config.orchestrator
    evals: list[dict[str, Any]] = []  # the curve: each eval on the curve's tasks (`curve_tasks_per_family`)
    start_whole: dict[str, Any] | None = None  # the start's eval on the whole held-out set (the end's: `final`)
    curve_tasks = eval_tasks(config, config.curve_per_family)
    eval_s = 0.0  # wall seconds of the in-loop evals, outside `time_budget_s`

    def record_eval(report: dict[str, Any], step: int) -> None:
        nonlocal start_whole
        if step == 0 and not evals:
            start_whole = report
        if len(report.get("per_task") or {}) > len(curve_tasks):
            report = on_tasks(report, curve_tasks)
        row = {"step": step, "policy_version": learner.version, "time_s": time.perf_counter() - start,
               "cpu_s": cpu_seconds() - cpu_start, **report}
        if step > 0 and evals and evals[0]["step"] == 0:  # the paired change from the start, so far
            row["lift"] = paired_lift(evals[0], report)
        evals.append(row)
        run.append("eval.jsonl", row)
        tracker.log({"eval": report}, step)
        tracker.table("eval", eval_table(report), step)
        log(f"eval at step {step} (policy {learner.version}): pass rate {report['pass_rate']:.3f} "
            f"[{report['pass_rate_ci'][0]:.2f}, {report['pass_rate_ci'][1]:.2f}], "
            f"valid tool calls {report['valid_tool_call_rate']:.2f}, failed {report['failed_tool_call_rate']:.2f}"
            + (f"; from the start {lift['diff']:+.3f} [{lift['ci'][0]:+.3f}, {lift['ci'][1]:+.3f}], "
               f"{lift['gained']} gained {lift['lost']} lost" if (lift := row.get("lift")) else ""))

    # cluster.backend: the Learner, the Engine and the episodes here, or as Ray actors (flywheel/rl/cluster.py)
    with Tracker(config.tracking, config.run_dir, params=config.model_dump(mode="json")) as tracker, \
            start_cluster(config.cluster, log) as cluster, \
            learner_for(config, cluster, learner_model, parent.version) as learner, \
            cluster.engine(engine_model, tokenizer, config.engine, config.pool, version=learner.version,
                           checkpoint=parent.path, weight_deltas=config.weight_deltas) as engine, \
            SandboxPool(config.pool) as pool, \
            episode_runner(config, cluster, engine, tokenizer, pool) as runner, \
            Orchestrator(orch_config, tasks, engine, tokenizer, pool, config.run_dir,
                         version=lambda: learner.version, runner=runner) as orchestrator:
        if resume(orch_config, orchestrator, learner, engine, run):
            log(f"resumed {config.run_dir} at step {orchestrator.step} (policy {learner.version})")
        elif start_report is not None:
            record_eval({**start_report, "source": "start_report"}, 0)
        elif config.eval_at_start:
            record_eval(run_eval(config, engine, tokenizer, pool), 0)
        log(f"training v{parent.version} on {len(tasks)} tasks: {orch_config.mode}, "
            f"G={orch_config.group_size} over {orch_config.tasks_per_group} task(s), B={orch_config.groups_per_step}, "
            f"max_staleness={orch_config.staleness_bound}")
        fleet = FleetLog(cluster, run, log)  # Ray: fleet.jsonl, off the step's path
        stepped: list[dict[str, Any]] = []  # this process's steps (a resumed run's earlier ones are not here)
        try:
            while orchestrator.step < orch_config.max_steps:
                if config.time_budget_s is not None and time.perf_counter() - start - eval_s > config.time_budget_s:
                    log(f"time budget of {config.time_budget_s:.0f} s reached at step {orchestrator.step}")
                    break
                if config.cpu_budget_s is not None and cpu_seconds() - cpu_start > config.cpu_budget_s:
                    log(f"CPU budget of {config.cpu_budget_s:.0f} s reached at step {orchestrator.step}")
                    break
                step_metrics = learning_step(orch_config, orchestrator, learner, engine, run,
                                             cpu_s=lambda: cpu_seconds() - cpu_start)
                stepped.append(step_metrics)
                tracker.log(step_metrics, step_metrics["step"])
                log(step_line(step_metrics))
                fleet.after_step(orchestrator.step)
                if config.save_policy_every and orchestrator.step % config.save_policy_every == 0:
                    save_policy(run, learner, orchestrator.step)
                if (config.eval_every and orchestrator.step % config.eval_every == 0
                        and orchestrator.step < orch_config.max_steps):
                    t_eval = time.perf_counter()
                    record_eval(run_eval(config, engine, tokenizer, pool, config.curve_per_family),
                                orchestrator.step)
                    eval_s += time.perf_counter() - t_eval
            run.wait_for_state()  # the last checkpoint is on disk (raises if it failed: LearnerLost restarts)
        finally:
            fleet.close()
            wait_quietly(run)  # a run that failed still lets its save finish before the learner goes
        orchestrator.close()  # in-flight episodes stop at a turn boundary, saved for a resume
        final = run_eval(config, engine, tokenizer, pool)
        record_eval(final, orchestrator.step)
        trained_model = learner.model  # the Ray learner's weights come back to this copy
    summary = {"steps": orchestrator.step, "policy_version": learner.version,
               "seconds": time.perf_counter() - start,
               "pass_rate_start": start_whole["pass_rate"] if start_whole is not None else float("nan"),
               "pass_rate_end": final["pass_rate"],
               # the paired change on the whole held-out set, start -> end (None without a start eval)
               "lift": paired_lift(start_whole, final) if start_whole is not None else None,
               # the held-out curve: each eval's step, pass rate, Wilson interval and change from the start
               "evals": [{k: e[k] for k in ("step", "pass_rate", "pass_rate_ci", "lift") if k in e} for e in evals],
               "anatomy": anatomy_totals(stepped)}
    checkpoint = None
    if config.register_checkpoint and orchestrator.step > 0:
        metrics = {"eval_pass_rate": final["pass_rate"], "eval_valid_tool_call_rate": final["valid_tool_call_rate"],
                   "train_steps": float(orchestrator.step)}
        trained = trained_model.eval() if config.lora is None else learner.adapter.eval()
        checkpoint = registry.register(trained, tokenizer, parent=parent.version, metrics=metrics,
                                       aliases=[config.alias] if config.alias else [], base=base,
                                       note=f"simulated RL ({orch_config.mode}), {orchestrator.step} steps"
                                       + (f", LoRA adapter of v{base}" if base is not None else ""))
        log(f"registered v{checkpoint.version} (parent v{parent.version}) at {checkpoint.path}")
    registry.close()
    run.write_json("summary.json", summary)
    return checkpoint, summary
