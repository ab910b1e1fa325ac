"""Evaluate a policy on a task set: pass rate per family with 95% intervals, tool-call validity.

Episodes run concurrently in threads against one Engine (which batches their generations) and
one SandboxPool. Intervals are Wilson score intervals: honest at the small counts a laptop eval
has, and never outside [0, 1].
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from flywheel.agent.episode import EpisodeConfig, run_episode
from flywheel.agent.trajectory import Trajectory
from flywheel.env.pool import SandboxPool
from flywheel.env.task import Task
from flywheel.model.engine import Engine
from flywheel.stats import mean_interval, paired_proportion_interval, wilson_interval


def passed(t: Trajectory) -> bool:
    return t.all_passed


def clustered_interval(fractions: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Interval of the mean of per-task pass fractions: with several samples per task the episodes
    are not independent (a task's samples mostly pass or fail together), so the spread is taken
    across tasks, not episodes (the t interval of their mean, clipped to [0, 1])."""
    if len(fractions) < 2:
        return (0.0, 1.0)
    interval = mean_interval(fractions, confidence)
    return (max(0.0, interval.low), min(1.0, interval.high))


def sampled(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """Pass rate over several samples per task: pass@1 (the mean), its interval across tasks, and
    pass@k (a task counts if any of its k samples passed), the share RL could reach by making the
    policy's own best answers its usual ones."""
    by_task: dict[str, list[bool]] = defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(passed(t))
    fractions = [sum(v) / len(v) for v in by_task.values()]
    return {"samples_per_task": min(len(v) for v in by_task.values()),
            "pass_rate_ci": list(clustered_interval(fractions)),
            "pass_at_k": sum(any(v) for v in by_task.values()) / len(by_task)}


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """The eval report: JSON-ready, keys as `flywheel eval --json` prints them. With several
    samples per task the intervals are across tasks and `pass_at_k` is added (`sampled`)."""
    report = _summarize(trajectories)
    if trajectories and len({t.task_id for t in trajectories}) < len(trajectories):
        report.update(sampled(trajectories))
        for family, row in report["per_family"].items():
            row.update(sampled([t for t in trajectories if t.family == family]))
    return report


def _summarize(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    by_family: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_family[t.family].append(t)
    n = len(trajectories)
    wins = sum(passed(t) for t in trajectories)
    calls = sum(t.tool_calls for t in trajectories)
    invalid = sum(t.invalid_tool_calls for t in trajectories)
    return {
        "episodes": n,
        "pass_rate": wins / n if n else 0.0,
        "pass_rate_ci": list(wilson_interval(wins, n)),
        "per_family": {
            family: {
                "episodes": len(ts),
                "pass_rate": sum(passed(t) for t in ts) / len(ts),
                "pass_rate_ci": list(wilson_interval(sum(passed(t) for t in ts), len(ts))),
                "mean_reward": sum(t.reward for t in ts) / len(ts),
            }
            for family, ts in sorted(by_family.items())
        },
        "valid_tool_call_rate": (calls - invalid) / calls if calls else 0.0,
        "tool_calls": calls,
        # valid calls the tool refused
        "failed_tool_call_rate": sum(t.failed_tool_calls for t in trajectories) / calls if calls else 0.0,
        "mean_turns": sum(t.turns for t in trajectories) / n if n else 0.0,
        "mean_tokens": sum(len(t.tokens) for t in trajectories) / n if n else 0.0,
        "mean_generated_tokens": sum(t.generated_tokens for t in trajectories) / n if n else 0.0,
        "mean_reward": sum(t.reward for t in trajectories) / n if n else 0.0,
        "status_counts": {s: sum(t.status == s for t in trajectories)
                          for s in sorted({t.status for t in trajectories})},
        "asked_question_rate": sum(t.asked_question for t in trajectories) / n if n else 0.0,
        # each task's share of passing episodes (0 or 1 with one sample): what a paired comparison of
        # two evals on the same tasks needs (`paired_lift`)
        "per_task": {task: sum(passed(t) for t in ts) / len(ts) for task, ts in sorted(_by_task(trajectories).items())},
    }


def _by_task(trajectories: Sequence[Trajectory]) -> dict[str, list[Trajectory]]:
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(t)
    return by_task


def paired_lift(before: dict[str, Any], after: dict[str, Any], confidence: float = 0.95) -> dict[str, Any] | None:
    """The pass-rate change from one eval report to another on the same tasks, with its paired interval
    (Tango's, `stats.paired_proportion_interval`; tasks played once each, e.g. greedily). None where the
    two reports share no task or either lacks per-task results (reports written before they had them)."""
    a, b = before.get("per_task") or {}, after.get("per_task") or {}
    common = sorted(set(a) & set(b))
    if not common or any(a[t] not in (0.0, 1.0) or b[t] not in (0.0, 1.0) for t in common):
        return None
    wins = sum(b[t] > a[t] for t in common)
    losses = sum(b[t] < a[t] for t in common)
    diff, low, high = paired_proportion_interval(wins, losses, len(common), confidence)
    return {"before": sum(a[t] for t in common) / len(common), "after": sum(b[t] for t in common) / len(common),
            "diff": diff, "ci": [low, high], "tasks": len(common), "gained": wins, "lost": losses,
            "significant": low > 0 or high < 0}


def gain_needed(lost: int, tasks: int, confidence: float = 0.95) -> int | None:
    """The fewest tasks gained that, with `lost` tasks lost of `tasks`, make the paired change of
    `paired_lift` significant (its interval above 0); None if no number of them would. What an eval
    of this size can show: on 96 tasks with none lost, 4 gained."""
    for wins in range(tasks - lost + 1):
        if paired_proportion_interval(wins, lost, tasks, confidence).low > 0:
            return wins
    return None


def evaluate(tasks: Sequence[Task], engine: Engine, tokenizer: PreTrainedTokenizerBase, pool: SandboxPool,
             config: EpisodeConfig | None = None, concurrency: int = 32, progress: bool = True,
             samples: int = 1) -> tuple[dict[str, Any], list[Trajectory]]:
    """Run every task `samples` times (more than one only makes sense with temperature > 0)."""
    config = config or EpisodeConfig()
    if samples < 1:
        raise ValueError(f"samples must be ≥ 1, got {samples}")
    with ThreadPoolExecutor(concurrency, thread_name_prefix="eval") as workers:
        futures = [workers.submit(run_episode, task, engine, tokenizer, pool, config) for task in tasks
                   for _ in range(samples)]
        results = []
        for f in tqdm(futures, desc="eval", unit="episode", disable=not progress, dynamic_ncols=True):
            results.append(f.result())
    return summarize(results), results
