"""A/B analysis: is the candidate better than production on live traffic? Promote, roll back or wait.

    report = analyze(completions, RewardDistiller(config).distill(completions, events, now), ABConfig())
    report.decision  # "promote" | "rollback" | "wait"

The server routes whole sessions to an arm (`Completion.arm`); answers of any other arm (a request
that pinned its version) are left out and counted in `ABReport.outside`. Per arm, and for the difference
candidate - production, with two-sided `confidence` intervals:

| metric        | unit                                    | interval of the difference      | better |
|---------------|-----------------------------------------|---------------------------------|--------|
| persistence   | edits (feedback window closed) kept     | Newcombe hybrid score           | higher |
| dissatisfied  | answers (window closed) followed by an  | Newcombe hybrid score           | lower  |
|               | unhappy follow-up                       |                                 |        |
| invalid_calls | answers with >= 1 invalid tool call     | Newcombe hybrid score           | lower  |
| latency       | seconds per answer                      | Welch                           | lower  |
| reward        | trainable rewards (final or defaulted)  | Welch                           | higher |

Newcombe rather than Wald for rates: it keeps its coverage at the small rates guardrails live at
(a few percent of invalid calls) where Wald's interval is too narrow. Outcomes are read from
`Reward.signals`, so they do not depend on the reward weights.

Decision, in order:
1. `wait` until both arms have `min_per_arm` answers whose feedback window closed.
2. `rollback` when any guardrail or success metric is significantly worse (its interval lies
   wholly on the bad side of 0).
3. `promote` when a success metric is significantly better (by default persistence and reward;
   a deployment that counts fewer unhappy follow-ups as a win lists `dissatisfied` there instead
   of among the guardrails, as configs/live.toml does).
4. otherwise `rollback`: a candidate that shows no gain is not worth the risk of a change.

Sessions, not answers, are the randomization unit, and answers of one session are correlated (one
user, one task, one stretch of the machine's load). So every interval above is computed on each
arm's effective sample size, its answers divided by their design effect over sessions
(`flywheel.stats.design_effect`: the cluster-robust variance of the arm's mean over the i.i.d. one,
at least 1); `MetricComparison.design_effect` reports it per arm. An arm of one-answer sessions is
analysed exactly as before; one of 10 sessions of 5 identical answers counts as 10. `cluster_by =
"answer"` turns it off (the per-answer analysis, too narrow when sessions are long).

Error rates. Each interval is two-sided at `confidence`, so one metric falsely looks better with
probability (1 - confidence) / 2; with k success metrics a candidate equal to production is promoted
at most k (1 - confidence) / 2 of the time (2.5% each at 0.95; union bound). A caveat the numbers
do not capture: deciding again after every batch ("peeking") inflates the false-promote rate.
`min_per_arm` keeps it in check, it does not remove it; decide once, at a planned sample, when the
stakes are high.

Floating-point resolution. A difference is only significant when its interval clears 0 by more
than the rounding error of the means (`_RESOLUTION` times the largest value's magnitude): two arms
whose every reward is the same constant have means that differ in the last bit (0.1 summed 2 and
12 times), and Welch's interval of such zero-variance arms is that difference, [4.7e-18, 2.3e-17],
which without the guard "promotes". Below the resolution a difference is `no_difference`.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flywheel.live.records import Completion
from flywheel.live.rewards import EDIT_TOOLS, Reward, RewardStatus, made_edit
from flywheel.stats import (
    design_effect,
    mean_interval,
    newcombe_interval,
    welch_interval,
    wilson_interval,
    z_quantile,
)

ARMS = ("production", "candidate")
# Relative rounding error allowed for a mean of floats (module docstring): far above fsum's and the
# division's few ulps, far below any difference a metric could show (1e-13 of a reward's scale).
_RESOLUTION = 512 * sys.float_info.epsilon
Metric = Literal["persistence", "dissatisfied", "invalid_calls", "latency", "reward"]
Verdict = Literal["better", "worse", "no_difference", "insufficient"]


class ABConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Answers with a closed feedback window each arm needs before any decision. Larger detects
    # smaller effects and tolerates more peeking, at the cost of longer exposure to a bad candidate.
    min_per_arm: int = Field(200, ge=2)
    confidence: float = Field(0.95, gt=0.5, lt=1)
    # Any metric may be either. A success metric promotes when significantly better and rolls back
    # when significantly worse; a guardrail only rolls back. Each success metric adds its
    # (1 - confidence) / 2 to the false-promote rate (module docstring).
    success_metrics: list[Metric] = Field(default_factory=lambda: ["persistence", "reward"], min_length=1)
    guardrails: list[Metric] = Field(default_factory=lambda: ["dissatisfied", "latency", "invalid_calls"])
    # The unit the intervals treat as independent: "session" (the unit the split randomizes; module
    # docstring) or "answer" (each answer independent: too narrow when sessions are long).
    cluster_by: Literal["session", "answer"] = "session"
    edit_tools: list[str] = Field(default_factory=lambda: list(EDIT_TOOLS), min_length=1)

    @model_validator(mode="after")
    def _disjoint(self) -> ABConfig:
        both = sorted(set(self.success_metrics) & set(self.guardrails))
        if both:
            raise ValueError(f"{', '.join(both)} is both a success metric and a guardrail; a success metric "
                             "already rolls back when significantly worse, so list it once")
        return self


class MetricComparison(BaseModel):
    name: str
    higher_is_better: bool
    method: str  # newcombe | welch
    n_production: int
    n_candidate: int
    production: float | None  # the arm's rate or mean; None without data
    candidate: float | None
    production_ci: tuple[float, float] | None  # Wilson (rates) or t (means)
    candidate_ci: tuple[float, float] | None
    diff: float | None  # candidate - production
    ci_low: float | None
    ci_high: float | None
    verdict: Verdict
    # Each arm's design effect over sessions (production, candidate): its answers over its effective
    # sample size (module docstring); 1 for one-answer sessions and with cluster_by = "answer".
    design_effect: tuple[float, float] = (1.0, 1.0)


class ABReport(BaseModel):
    decision: Literal["promote", "rollback", "wait"]
    reason: str
    confidence: float
    closed: dict[str, int]  # arm -> answers whose feedback window closed
    versions: dict[str, list[int]]  # arm -> policy versions seen in it
    outside: dict[str, int]  # answers of other arms (e.g. pinned evals), left out of the comparison
    metrics: dict[str, MetricComparison]


@dataclass(frozen=True)
class _Metric:
    higher_is_better: bool
    proportion: bool


_METRICS = {
    "persistence": _Metric(higher_is_better=True, proportion=True),
    "dissatisfied": _Metric(higher_is_better=False, proportion=True),
    "invalid_calls": _Metric(higher_is_better=False, proportion=True),
    "latency": _Metric(higher_is_better=False, proportion=False),
    "reward": _Metric(higher_is_better=True, proportion=False),
}


def metric_rows(name: str, arm: Sequence[tuple[Completion, Reward]],
                edit_tools: Sequence[str]) -> list[tuple[float, str]]:
    """The metric's per-answer values in one arm (0/1 for rates), each with the answer's session."""
    closed = [(c, r) for c, r in arm if r.status is not RewardStatus.PENDING]
    match name:
        case "persistence":
            return [(float(r.signals.get("edit_persisted", 0) > 0), c.session_id) for c, r in closed
                    if made_edit(c, edit_tools)]
        case "dissatisfied":
            return [(float(r.signals.get("followup_dissatisfied", 0) > 0), c.session_id) for c, r in closed]
        case "invalid_calls":
            return [(float(c.invalid_tool_calls > 0), c.session_id) for c, _ in arm]
        case "latency":
            return [(c.latency_ms / 1000, c.session_id) for c, _ in arm]
        case "reward":
            return [(r.reward, c.session_id) for c, r in arm if r.trainable]
    raise ValueError(f"unknown A/B metric {name!r}; the metrics are: {', '.join(_METRICS)}")


def compare(name: str, production: Sequence[float], candidate: Sequence[float], confidence: float,
            sessions: tuple[Sequence[str], Sequence[str]] | None = None) -> MetricComparison:
    """One metric's per-arm values, the interval of candidate - production and its verdict.
    `sessions`: each value's session per arm (production, candidate); the intervals then use each
    arm's effective sample size (module docstring). None: every value independent."""
    spec = _METRICS[name]
    method = "newcombe" if spec.proportion else "welch"
    base = {"name": name, "higher_is_better": spec.higher_is_better, "method": method,
            "n_production": len(production), "n_candidate": len(candidate)}
    if len(production) < 2 or len(candidate) < 2:
        return MetricComparison(**base, production=None, candidate=None, production_ci=None, candidate_ci=None,
                                diff=None, ci_low=None, ci_high=None, verdict="insufficient")
    dp, dc = (1.0, 1.0) if sessions is None else (design_effect(production, sessions[0]),
                                                   design_effect(candidate, sessions[1]))
    if spec.proportion:
        z = z_quantile(0.5 + confidence / 2)
        # effective counts: each arm's answers over its design effect, its rate unchanged
        np_, nc = len(production) / dp, len(candidate) / dc
        pp, pc = sum(production) / len(production), sum(candidate) / len(candidate)
        diff = newcombe_interval(pc * nc, nc, pp * np_, np_, confidence)
        arms = {"production": (pp, wilson_interval(pp * np_, np_, z)),
                "candidate": (pc, wilson_interval(pc * nc, nc, z))}
    else:
        diff = welch_interval(candidate, production, confidence, design=(dc, dp))
        arms = {arm: (m.estimate, (m.estimate - (m.estimate - m.low) * math.sqrt(d),
                                   m.estimate + (m.high - m.estimate) * math.sqrt(d)))
                for arm, m, d in (("production", mean_interval(production, confidence), dp),
                                  ("candidate", mean_interval(candidate, confidence), dc))}
    # An interval inside the means' rounding error says nothing (module docstring).
    resolution = _RESOLUTION * max((abs(v) for v in (*production, *candidate) if math.isfinite(v)), default=0.0)
    above, below = diff.low > resolution, diff.high < -resolution
    verdict: Verdict = "no_difference"
    if above or below:
        verdict = "better" if above == spec.higher_is_better else "worse"
    return MetricComparison(**base, production=arms["production"][0], candidate=arms["candidate"][0],
                            production_ci=arms["production"][1], candidate_ci=arms["candidate"][1],
                            diff=diff.estimate, ci_low=diff.low, ci_high=diff.high, verdict=verdict,
                            design_effect=(dp, dc))


def compare_rows(name: str, production: Sequence[tuple[float, str]], candidate: Sequence[tuple[float, str]],
                 config: ABConfig) -> MetricComparison:
    """`compare` on two arms' `metric_rows`, their sessions counted as `config.cluster_by` says."""
    sessions = (None if config.cluster_by == "answer"
                else ([s for _, s in production], [s for _, s in candidate]))
    return compare(name, [v for v, _ in production], [v for v, _ in candidate], config.confidence, sessions)


def analyze(completions: Sequence[Completion], rewards: Sequence[Reward], config: ABConfig | None = None) -> ABReport:
    """Compare the arms and decide (module docstring). Every completion needs its reward."""
    config = config or ABConfig()
    by_id = {r.completion_id: r for r in rewards}
    arms: dict[str, list[tuple[Completion, Reward]]] = {arm: [] for arm in ARMS}
    outside: Counter[str] = Counter()
    for c in completions:
        if c.arm not in arms:  # e.g. "pinned": a request that named its version, outside the split
            outside[c.arm] += 1
            continue
        if c.id not in by_id:
            raise ValueError(f"completion {c.id} has no reward; pass RewardDistiller.distill() of the same completions")
        arms[c.arm].append((c, by_id[c.id]))
    closed = {arm: sum(r.status is not RewardStatus.PENDING for _, r in pairs) for arm, pairs in arms.items()}
    names = list(dict.fromkeys([*config.success_metrics, *config.guardrails]))
    metrics = {name: compare_rows(name, metric_rows(name, arms["production"], config.edit_tools),
                                  metric_rows(name, arms["candidate"], config.edit_tools), config)
               for name in names}
    versions = {arm: sorted({c.version for c, _ in pairs}) for arm, pairs in arms.items()}

    def report(decision: Literal["promote", "rollback", "wait"], reason: str) -> ABReport:
        return ABReport(decision=decision, reason=reason, confidence=config.confidence, closed=closed,
                        versions=versions, outside=dict(outside), metrics=metrics)

    short = [f"{arm} has {n}" for arm, n in closed.items() if n < config.min_per_arm]
    if short:
        return report("wait", f"{' and '.join(short)} answers with closed feedback windows; "
                              f"min_per_arm is {config.min_per_arm}")
    worse = [name for name, m in metrics.items() if m.verdict == "worse"]
    if worse:
        return report("rollback", f"significantly worse: {', '.join(worse)}")
    better = [name for name in config.success_metrics if metrics[name].verdict == "better"]
    if better:
        return report("promote", f"significantly better: {', '.join(better)}; no metric significantly worse")
    return report("rollback", f"no success metric ({', '.join(config.success_metrics)}) improved significantly")
