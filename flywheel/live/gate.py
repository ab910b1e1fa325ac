"""The eval gate: may the candidate replace production? The statistics, and the battery that feeds them.

    gate = Gate(load_config(GateConfig, "configs/gate.toml"))
    run = gate.run(Contender(cand_engine, tokenizer, 4), Contender(prod_engine, tokenizer, 3), pool)
    if run.decision.passed: start the A/B test

    # or with results from elsewhere: {task id: {metric: value}} per version
    decision = gate.decide(candidate_results, production_results)

The battery (`EvalBattery`): the held-out tasks of the procedural families (`held_out_tasks`),
HumanEval problems when `humaneval_tasks` > 0 (for a real checkpoint; the embedded tiny model
solves none, so they would only cost time), and the behaviour checks below. Both versions play
every task through `flywheel.agent.evaluate`, concurrently, at the battery's temperature: once
at temperature 0 by default (greedy decoding makes the comparison paired in the strongest sense,
an identical candidate gives identical results up to float noise in batched decoding), or
`samples` times at the temperature users sample at. A task's result is then the mean over its
samples (a pass fraction), which the t interval below takes. Sampling is for small batteries:
greedy decoding turns a small shift of probability into a whole task won or lost, so a candidate
that only moved a coin-flip task from one answer to another shows discordant pairs that a few
dozen tasks cannot tell from a regression; k samples measure the shift itself.

Both versions are evaluated on the same held-out tasks, so results are paired per task. Pairing
removes the between-task variance (a hard task is hard for both), which is most of it: the test
sees only the per-task differences d_i = candidate_i - production_i.

Non-inferiority, not superiority: a candidate trained on a day of live data rarely moves held-out
pass rate measurably, and the gate's job is to stop regressions. It passes when the one-sided
(1 - alpha) lower confidence bound of mean(d) is above -margin.

Method, by the kind of result:
- 0/1 outcomes (pass/fail): Tango's score test for paired proportions (Tango 1998, Stat Med 17),
  inverted by bisection for the interval. Its variance is taken under the null hypothesis, so it
  keeps its level at rates near 0 and 1, where the t interval on 0/1 differences does not (at 200
  tasks and a 10% discordance rate the t interval passes a candidate exactly `margin` worse ~10% of
  the time instead of 5%; Tango's test ~5%, see tests/live/test_gate.py).
- anything else (rewards, rates): the t interval of the paired differences (normal approximation
  of their mean, Student's t quantile with n - 1 df).
Below `min_tasks` pairs the gate fails closed, with a reason saying to add eval tasks. Identical
versions pass when there are enough tasks for the margin: with no discordant pair Tango's bound is
-margin at n = z^2 (1 - margin) / margin, i.e. 52 tasks for a 0.05 margin at alpha 0.05.

Behaviour checks (`RateLimitCheck`) bound a rate of the candidate alone, on a subset of tasks, e.g.
clarifying questions on clear (non-ambiguous) tasks at most 20%. They compare the point estimate
with the limit, so they also fail closed; the Wilson interval is reported for context.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import PreTrainedTokenizerBase

from flywheel.agent.episode import EpisodeConfig
from flywheel.agent.evaluate import evaluate, passed
from flywheel.agent.trajectory import Trajectory
from flywheel.env.families import FAMILIES, held_out_tasks
from flywheel.env.pool import SandboxPool
from flywheel.env.task import Task
from flywheel.model.engine import Engine
from flywheel.stats import mean_and_variance, paired_proportion_interval, t_quantile, wilson_interval, z_quantile

TaskResults = Mapping[str, Mapping[str, float | bool | None]]  # task id -> metric -> value (None: n/a)


def task_results(tasks: Sequence[Task],
                 trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float | bool | None]]:
    """Per-task results for `Gate.decide`, with the keys the default checks read, from the eval
    episodes of each task: one (a 0/1 result), or several samples (their mean: a pass fraction,
    the share of episodes that asked a question, and the valid share of all their tool calls)."""
    by_task = {t.id: t for t in tasks}
    episodes: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        if t.task_id not in by_task:
            raise ValueError(f"episode of task {t.task_id}, which is not among the tasks given")
        episodes.setdefault(t.task_id, []).append(t)
    out: dict[str, dict[str, float | bool | None]] = {}
    for task_id, runs in episodes.items():
        calls = sum(t.tool_calls for t in runs)
        out[task_id] = {
            "passed": sum(passed(t) for t in runs) / len(runs),
            "valid_tool_call_rate": sum(t.tool_calls - t.invalid_tool_calls for t in runs) / calls if calls else None,
            "asked_question": sum(t.asked_question for t in runs) / len(runs),
            "ambiguous": by_task[task_id].metadata.ambiguous,
        }
    return out


class GateResult(BaseModel):
    passed: bool
    # None where the check could not be computed (too few tasks); it then fails.
    diff: float | None  # non-inferiority: mean(candidate - production); rate limit: rate - limit
    ci_low: float | None  # two-sided (1 - 2 alpha) interval; its low end is the one-sided (1 - alpha) bound
    ci_high: float | None
    n: int
    reason: str
    method: str = ""  # tango | t | wilson
    check: str = ""
    margin: float | None = None  # non-inferiority checks: how much worse the candidate may be


def non_inferiority(candidate: Sequence[float], production: Sequence[float], margin: float,
                    alpha: float = 0.05, min_n: int = 20) -> GateResult:
    """Paired test that candidate is not worse than production by more than `margin` (higher is better)."""
    if len(candidate) != len(production):
        raise ValueError(f"paired test needs one candidate and one production result per task, got "
                         f"{len(candidate)} and {len(production)}; evaluate both on the same tasks")
    if margin < 0 or not 0 < alpha < 0.5:
        raise ValueError(f"margin={margin} must be >= 0 and alpha={alpha} in (0, 0.5)")
    n = len(candidate)
    if n < max(min_n, 2):
        return GateResult(passed=False, diff=None, ci_low=None, ci_high=None, n=n,
                          reason=f"only {n} paired tasks, need {max(min_n, 2)}: add eval tasks")
    if all(float(v) in (0.0, 1.0) for v in (*candidate, *production)):
        b = sum(c > p for c, p in zip(candidate, production, strict=True))  # candidate won the task
        c = sum(c < p for c, p in zip(candidate, production, strict=True))  # production won it
        mean, method = (b - c) / n, "tango"
        _, low, high = paired_proportion_interval(b, c, n, 1 - 2 * alpha)
    else:
        diffs = [float(c) - float(p) for c, p in zip(candidate, production, strict=True)]
        mean, var = mean_and_variance(diffs)
        half = t_quantile(1 - alpha, n - 1) * math.sqrt(var / n)
        low, high, method = mean - half, mean + half, "t"
    passed = low > -margin
    verdict = "above" if passed else "not above"
    return GateResult(passed=passed, diff=mean, ci_low=low, ci_high=high, n=n, method=method,
                      reason=f"{1 - alpha:.0%} lower bound {low:+.3f} of the paired difference {mean:+.3f} "
                             f"({method}, {n} tasks) is {verdict} -margin {-margin:+.3f}")


def rate_limit(values: Sequence[bool | float], max_rate: float, alpha: float = 0.05) -> GateResult:
    """Passes when the mean of per-task values (0/1, or a task's share over its samples) is at most
    max_rate (point estimate; fails closed)."""
    n = len(values)
    if n == 0:
        return GateResult(passed=False, diff=None, ci_low=None, ci_high=None, n=0,
                          reason="no tasks in this check's subset: add eval tasks of that kind")
    if any(not 0.0 <= float(v) <= 1.0 for v in values):
        raise ValueError(f"a rate check needs per-task values in [0, 1], got {sorted(map(float, values))[-1]}")
    hits = sum(float(v) for v in values)
    rate = hits / n
    low, high = wilson_interval(hits, n, z_quantile(1 - alpha))  # per task: samples of one task are not independent
    passed = rate <= max_rate
    return GateResult(passed=passed, diff=rate - max_rate, ci_low=low - max_rate, ci_high=high - max_rate, n=n,
                      method="wilson",
                      reason=f"rate {rate:.3f} ({hits:g}/{n}) is {'within' if passed else 'above'} the limit "
                             f"{max_rate:.3f}")


class NonInferiorityCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str  # key of the per-task results, e.g. "passed"
    # How much worse the candidate may be. Smaller margins need more eval tasks to pass: the bound's
    # half-width shrinks like 1/sqrt(tasks).
    margin: float = Field(0.05, ge=0)
    higher_is_better: bool = True


class RateLimitCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metric: str  # a per-task 0/1 result, e.g. "asked_question"
    max_rate: float = Field(ge=0, le=1)
    where: dict[str, bool] = Field(default_factory=dict)  # only tasks whose results match, e.g. {"ambiguous": false}


def _default_checks() -> dict[str, NonInferiorityCheck | RateLimitCheck]:
    return {
        "pass_rate": NonInferiorityCheck(metric="passed", margin=0.05),
        "valid_tool_call_rate": NonInferiorityCheck(metric="valid_tool_call_rate", margin=0.02),
        "clarify_on_clear": RateLimitCheck(metric="asked_question", max_rate=0.2, where={"ambiguous": False}),
    }


class EvalBattery(BaseModel):
    """The held-out tasks both versions play (module docstring)."""

    model_config = ConfigDict(extra="forbid")
    families: list[str] = Field(default_factory=lambda: list(FAMILIES), min_length=1)
    # Per family. More tasks narrow the paired interval (like 1/sqrt(tasks)) at the cost of eval time;
    # with no discordant pair the pass-rate check needs about z^2 (1 - margin) / margin tasks in all.
    tasks_per_family: int = Field(16, ge=1)
    difficulty: int | None = Field(1, ge=1, le=3)  # None: cycle through 1, 2, 3
    humaneval_tasks: int = Field(0, ge=0)  # HumanEval problems (eval split); set > 0 for a real checkpoint
    concurrency: int = Field(16, ge=1)  # episodes in flight per version; the engine batches their turns
    # Episodes per task and version. 1 with greedy decoding (the default); more only with a temperature
    # above 0, for a battery too small for greedy's all-or-nothing results (module docstring).
    samples: int = Field(1, ge=1)
    episode: EpisodeConfig = Field(default_factory=lambda: EpisodeConfig(temperature=0.0))

    @model_validator(mode="after")
    def _sampling(self) -> EvalBattery:
        if self.samples > 1 and self.episode.temperature == 0:
            raise ValueError(f"samples = {self.samples} at temperature 0 plays the same greedy episode "
                             f"{self.samples} times; set battery.episode.temperature > 0 or samples = 1")
        return self

    def tasks(self) -> list[Task]:
        # The bootstrap's held-out set, so gate numbers compare with its eval.
        return held_out_tasks(self.families, self.tasks_per_family, self.difficulty, humaneval=self.humaneval_tasks)


class GateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # One-sided error of each non-inferiority check: the chance a candidate truly `margin` worse passes it.
    alpha: float = Field(0.05, gt=0, lt=0.5)
    min_tasks: int = Field(20, ge=2)  # fewer paired tasks than this fail the check (module docstring)
    checks: dict[str, NonInferiorityCheck | RateLimitCheck] = Field(default_factory=_default_checks, min_length=1)
    battery: EvalBattery = Field(default_factory=EvalBattery)


class GateDecision(BaseModel):
    passed: bool  # every check passed
    checks: dict[str, GateResult]

    @property
    def failed(self) -> list[str]:
        return [name for name, r in self.checks.items() if not r.passed]


@dataclass(frozen=True)
class Contender:
    """One version as the gate plays it: an engine at that version and its tokenizer."""

    engine: Engine
    tokenizer: PreTrainedTokenizerBase
    version: int


class GateRun(BaseModel):
    """What `Gate.run` did: the decision, and each version's eval summary on the same tasks."""

    decision: GateDecision
    candidate_version: int
    production_version: int
    tasks: int
    candidate: dict[str, Any]  # flywheel.agent.evaluate.summarize of the candidate's episodes
    production: dict[str, Any]
    seconds: float


class Gate:
    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config or GateConfig()

    def run(self, candidate: Contender, production: Contender, pool: SandboxPool,
            tasks: Sequence[Task] | None = None) -> GateRun:
        """Play the battery (or `tasks`) with both versions, concurrently, and decide on the paired results."""
        start = time.perf_counter()
        tasks = list(tasks) if tasks is not None else self.config.battery.tasks()
        battery = self.config.battery

        def play(contender: Contender) -> tuple[dict[str, Any], list[Trajectory]]:
            if contender.engine.version != contender.version:
                raise ValueError(f"the engine for v{contender.version} is at version {contender.engine.version}; "
                                 "give each Contender the engine that serves its version")
            return evaluate(tasks, contender.engine, contender.tokenizer, pool, battery.episode,
                            concurrency=battery.concurrency, progress=False, samples=battery.samples)

        # Both at once: two engines keep both cores busy while the other waits on sandboxes.
        with ThreadPoolExecutor(2, thread_name_prefix="gate") as workers:
            cand, prod = workers.map(play, (candidate, production))
        decision = self.decide(task_results(tasks, cand[1]), task_results(tasks, prod[1]))
        return GateRun(decision=decision, candidate_version=candidate.version, production_version=production.version,
                       tasks=len(tasks), candidate=cand[0], production=prod[0], seconds=time.perf_counter() - start)

    def decide(self, candidate: TaskResults, production: TaskResults) -> GateDecision:
        missing = sorted(set(production) ^ set(candidate))
        if missing:
            raise ValueError(f"candidate and production were evaluated on different tasks ({len(missing)} "
                             f"differ, e.g. {missing[:3]}); evaluate both on the same task set")
        results = {name: self._check(check, candidate, production).model_copy(update={
                       "check": name, "margin": check.margin if isinstance(check, NonInferiorityCheck) else None})
                   for name, check in self.config.checks.items()}
        return GateDecision(passed=all(r.passed for r in results.values()), checks=results)

    def _check(self, check: NonInferiorityCheck | RateLimitCheck, candidate: TaskResults,
               production: TaskResults) -> GateResult:
        tasks = sorted(candidate)
        if isinstance(check, RateLimitCheck):
            chosen = [t for t in tasks if all(candidate[t].get(k) == v for k, v in check.where.items())]
            return rate_limit([float(candidate[t].get(check.metric) or 0.0) for t in chosen], check.max_rate,
                              self.config.alpha)
        # Tasks where the metric is undefined for either version (e.g. no tool calls) leave the pair out.
        pairs = [(candidate[t].get(check.metric), production[t].get(check.metric)) for t in tasks]
        pairs = [(float(c), float(p)) for c, p in pairs if c is not None and p is not None]
        if tasks and not pairs:
            return GateResult(passed=False, diff=None, ci_low=None, ci_high=None, n=0,
                              reason=f"no task has {check.metric!r} in both results; check the metric name")
        if not check.higher_is_better:  # 1 - v, not -v: same differences, and 0/1 results stay 0/1
            pairs = [(1.0 - c, 1.0 - p) for c, p in pairs]
        return non_inferiority([c for c, _ in pairs], [p for _, p in pairs], check.margin,
                               self.config.alpha, self.config.min_tasks)
