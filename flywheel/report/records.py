"""What the report reads: the records the trainer and the real-time cycle write, as they write them.

    cycles = read_cycle_records(run_dir, problems)     # cycle-NNNN/report.json, else cycle-NNNN/state.json

Inputs, by source:
- a simulated-RL run folder (flywheel/rl/train.py): `metrics.jsonl`, one `TrainStep` per line,
  `eval.jsonl`, one `EvalPoint` per held-out eval (step 0: the start checkpoint's), on Ray
  `fleet.jsonl`, one `FleetPoint` per step (sandboxes per node), and once the run
  has finished, `summary.json`'s paired held-out change (`HeldOutLift`).
- real-time RL cycles: flywheel/live/cycle.py's own record, `cycle-NNNN/report.json` (its
  `CycleReport`, schema "flywheel.cycle/1") or, while the cycle runs, `cycle-NNNN/state.json` (its
  `CycleState`, the same fields so far plus `stage`). There is no second cycle format: `CycleRecord`
  is the part of that record the report draws, under the writer's own field names and nesting
  (`production`, `candidate`, `gate.decision.checks`, `ab.metrics`, `monitor.series`), declared here
  only so that this package imports nothing of flywheel (the live server imports it, and a report
  renders without torch). tests/report/test_report.py reads a real CycleReport and CycleState.

Every section is optional and every field that a writer may not know yet may be None: the report
draws "no data yet" rather than failing. Records ignore fields they do not know, so a newer writer
can add fields, and the live records validate as they are (pydantic objects or their dumps): a
`GateDecision.checks` dict, an `ABReport.metrics` dict, `Alarm`s and `MetricPoint`s.

Reading tolerates a run in progress: a last line still being appended is skipped; any other
unreadable line or file is named in the report's problems, not silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

_RECORD = ConfigDict(extra="ignore")
_STALENESS_KEY = re.compile(r"staleness/(\d+)")
_ANATOMY_KEY = re.compile(r"(time|tokens)/(\w+)")
CYCLE_DIR = re.compile(r"cycle-(\d+)")
CYCLE_DIR_FILES = ("report.json", "state.json")  # in a CYCLE_DIR, the first present is read


def _finite_or_none(value: Any) -> Any:
    """NaN and infinities (a diverged step, an undefined correlation) become None: unknown, and valid JSON."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class _Record(BaseModel):
    model_config = _RECORD

    @model_validator(mode="before")
    @classmethod
    def _plain(cls, data: Any) -> Any:
        """Another pydantic record (a live `Alarm`, `GateResult`, ...) is read by its fields."""
        return data.model_dump() if isinstance(data, BaseModel) and not isinstance(data, cls) else data

    @field_validator("*", mode="before")
    @classmethod
    def _no_nan(cls, value: Any) -> Any:
        return _finite_or_none(value)


# ---- simulated RL (flywheel/rl/orchestrator.py writes metrics.jsonl, flywheel/rl/train.py eval.jsonl)


class TrainStep(_Record):
    step: int
    policy_version: int | None = None  # learner steps since the run's start; not a Registry version
    time: float | None = None  # wall clock (unix seconds) when the step finished
    reward_mean: float | None = None
    pass_rate: float | None = None  # of the batch's training episodes
    tokens_per_s: float | None = None
    staleness_max: float | None = None
    staleness_mean: float | None = None
    train_s: float | None = None
    wait_s: float | None = None
    filtered_groups: int | None = None
    # The draw (flywheel/rl/train.py `draw_metrics`): of the groups completed since the previous step,
    # the share on the frontier (some episodes passed, some failed) and with any signal; the pass rate
    # estimated for their tasks when drawn, beside the one the episodes had (`rollout_pass_rate`)
    groups_completed: int | None = None
    frontier_share: float | None = None
    signal_share: float | None = None
    draw_estimate: float | None = None
    rollout_pass_rate: float | None = None
    cpu_s: float | None = None  # the run's CPU seconds so far
    staleness: dict[int, float] = Field(default_factory=dict)  # learner steps behind -> generated tokens
    # The step's anatomy (flywheel/rl/train.py `step_anatomy`): stage -> seconds (`time/<stage>`), and
    # stage -> tokens (`tokens/<stage>`); not `seconds`, which is the Learner's step alone
    stage_seconds: dict[str, float] = Field(default_factory=dict)
    stage_tokens: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _histogram(cls, data: Any) -> Any:
        """The Learner writes its histogram as flat keys `staleness/<k>`, the loop its anatomy as
        `time/<stage>` and `tokens/<stage>`; gather them."""
        if not isinstance(data, Mapping):
            return data
        gathered: dict[str, Any] = {}
        if "staleness" not in data:
            histogram = {int(m.group(1)): v for k, v in data.items()
                         if (m := _STALENESS_KEY.fullmatch(k)) and isinstance(v, int | float) and math.isfinite(v)}
            if histogram:
                gathered["staleness"] = histogram
        for kind, prefix in (("stage_seconds", "time"), ("stage_tokens", "tokens")):
            if kind not in data:
                found = {m.group(2): v for k, v in data.items() if (m := _ANATOMY_KEY.fullmatch(k))
                         and m.group(1) == prefix and isinstance(v, int | float) and math.isfinite(v)}
                if found:
                    gathered[kind] = found
        return {**data, **gathered} if gathered else data


class HeldOutLift(_Record):
    """summary.json's `lift` (flywheel/agent/evaluate.py `paired_lift`): the held-out pass-rate change
    from the run's start (step 0) to its end on the same tasks, with its paired 95% interval."""

    before: float | None = None
    after: float | None = None
    diff: float | None = None
    ci: tuple[float, float] | None = None
    tasks: int | None = None
    gained: int | None = None  # tasks failed at the start and passed at the end
    lost: int | None = None
    significant: bool = False


class FamilyEval(_Record):
    pass_rate: float | None = None
    pass_rate_ci: tuple[float, float] | None = None
    episodes: int | None = None


class EvalPoint(_Record):
    step: int
    policy_version: int | None = None
    time_s: float | None = None  # seconds since the run started
    pass_rate: float | None = None
    pass_rate_ci: tuple[float, float] | None = None
    valid_tool_call_rate: float | None = None
    per_family: dict[str, FamilyEval] = Field(default_factory=dict)
    lift: HeldOutLift | None = None  # the paired change from the step-0 eval to this one


class FleetNode(_Record):
    """One node's sandbox fleet after a step (flywheel/rl/ray_backend.py `RayRollouts.stats`)."""

    live_sandboxes: float | None = None
    peak: float | None = None
    queued: float | None = None
    queue_wait_ms_p99: float | None = None
    created_per_s_recent: float | None = None
    resumed_episodes: float | None = None


class FleetPoint(_Record):
    """A line of a Ray run's fleet.jsonl: the sandbox fleet per node after learner step `step`."""

    step: int
    live_workers: int | None = None
    nodes: dict[str, FleetNode] = Field(default_factory=dict)


class TrainingRun(BaseModel):
    name: str  # the folder, relative to the report's root
    steps: list[TrainStep] = Field(default_factory=list)
    evals: list[EvalPoint] = Field(default_factory=list)
    fleet: list[FleetPoint] = Field(default_factory=list)  # Ray runs only (cluster.backend = "ray")
    lift: HeldOutLift | None = None  # None: the run has not finished, or had no eval at step 0

    @property
    def start_eval(self) -> EvalPoint | None:
        """The held-out eval of the start checkpoint (step 0), or None: the run's first eval may
        come later (no eval at the start), and it is not the start's figure."""
        return next((e for e in self.evals if e.step == 0), None)


# ---- real-time RL (flywheel/live/cycle.py writes one CycleReport per cycle, a CycleState per stage)


class GateCheck(_Record):
    name: str = Field(validation_alias=AliasChoices("name", "check"))
    passed: bool
    diff: float | None = None  # candidate - production (non-inferiority), or rate - limit (rate limits)
    ci_low: float | None = None
    ci_high: float | None = None
    margin: float | None = None  # the candidate may be this much worse; drawn at -margin
    n: int | None = None
    method: str = ""
    reason: str = ""


class ABMetric(_Record):
    name: str
    production: float | None = None
    candidate: float | None = None
    diff: float | None = None  # candidate - production
    ci_low: float | None = None
    ci_high: float | None = None
    significant: bool = False
    verdict: str = ""  # better | worse | no_difference | insufficient (ABReport's words), if known
    higher_is_better: bool | None = None
    n_production: int | None = None
    n_candidate: int | None = None

    @model_validator(mode="after")
    def _significant_from_verdict(self) -> ABMetric:
        if "significant" not in self.model_fields_set and self.verdict:
            self.significant = self.verdict in ("better", "worse")
        return self


class ReplayMetricRecord(_Record):
    candidate: float
    production: float
    worse: int
    better: int
    p_value: float | None = None
    alarm: bool = False


class ReplayRecord(_Record):
    """The distilled requests replayed by both versions (flywheel/live/replay.py)."""

    requests: int
    samples: int
    metrics: dict[str, ReplayMetricRecord] = Field(default_factory=dict)


class AlarmRecord(_Record):
    metric: str
    version: int
    window_start: float
    window_end: float | None = None
    value: float | None = None
    baseline_value: float | None = None
    severity: str = "critical"  # critical | warning
    blocks_promotion: bool = False
    p_value: float | None = None


class SeriesPoint(_Record):
    metric: str
    version: int
    window_start: float
    value: float | None = None
    n: int | None = None


def _named(value: Any) -> Any:
    """{name: result} (GateDecision.checks, ABReport.metrics) -> [{name, ...result}]; lists pass through."""
    if not isinstance(value, Mapping):
        return value
    out = []
    for name, item in value.items():
        fields = item.model_dump() if isinstance(item, BaseModel) else dict(item)
        out.append({**fields, "name": name})
    return out


class MonitorSnapshot(_Record):
    """Monitor series and alarms, from a cycle or from the live server's store (a `MonitorReport` reads as one)."""

    source: str = ""
    series: list[SeriesPoint] = Field(default_factory=list)
    alarms: list[AlarmRecord] = Field(default_factory=list)


class GateDecisionRecord(_Record):
    passed: bool | None = None
    checks: list[GateCheck] = Field(default_factory=list)

    @field_validator("checks", mode="before")
    @classmethod
    def _checks(cls, value: Any) -> Any:
        return _named(value)


class GateRecord(_Record):
    """`GateRun`: the decision and its checks (the versions' eval summaries are not drawn)."""

    decision: GateDecisionRecord = Field(default_factory=GateDecisionRecord)


class ABRecord(_Record):
    """`ABReport`: the A/B decision and each metric's comparison."""

    decision: str | None = None  # promote | rollback | wait
    reason: str = ""
    metrics: list[ABMetric] = Field(default_factory=list)

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics(cls, value: Any) -> Any:
        return _named(value)


class MonitorRecord(_Record):
    """`MonitorSummary`: the monitor series of the cycle's versions."""

    baseline_version: int | None = None
    series: list[SeriesPoint] = Field(default_factory=list)


class CycleRecord(_Record):
    """One real-time RL cycle as flywheel/live/cycle.py records it (module docstring): train a candidate,
    gate it, A/B test it, promote or roll back."""

    cycle: int
    trigger: str = ""
    started_at: float | None = None  # unix seconds
    production: int | None = None  # the registry version serving when the cycle started
    candidate: int | None = None  # the registry version trained this cycle
    production_after: int | None = None  # serving when the cycle ended
    gate: GateRecord | None = None  # None: the gate has not run (yet)
    replay: ReplayRecord | None = None  # None: nothing was distilled, or it has not run
    ab: ABRecord | None = None
    decision: str | None = None  # what the cycle did: promote | rollback | rejected (gate) | skipped | abandoned
    reason: str = ""
    alarms: list[AlarmRecord] = Field(default_factory=list)
    monitor: MonitorRecord | None = None
    timings: dict[str, float] = Field(default_factory=dict)  # stage -> seconds (total_s: the whole cycle)
    stage: str = "done"  # state.json: the last finished stage; a report.json is done

    @property
    def running(self) -> str | None:
        """The last finished stage of an unfinished cycle; None when the cycle is done."""
        return None if self.stage == "done" else self.stage

    @property
    def gate_checks(self) -> list[GateCheck]:
        return self.gate.decision.checks if self.gate is not None else []

    @property
    def gate_passed(self) -> bool | None:
        return self.gate.decision.passed if self.gate is not None else None

    @property
    def ab_decision(self) -> str | None:
        return self.ab.decision if self.ab is not None else None

    @property
    def ab_metrics(self) -> list[ABMetric]:
        return self.ab.metrics if self.ab is not None else []

    @property
    def series(self) -> list[SeriesPoint]:
        return self.monitor.series if self.monitor is not None else []

    @property
    def seconds(self) -> float | None:
        if not self.timings:
            return None
        return self.timings.get("total_s", sum(v for k, v in self.timings.items() if k != "total_s"))


class ReportData(BaseModel):
    """Everything one report or dashboard page shows. `build_report_data` returns it as a JSON dict."""

    title: str = "flywheel"
    generated_at: float = 0.0
    root: str = ""
    live: dict[str, str | int | float | None] = Field(default_factory=dict)  # facts shown in the header
    training: list[TrainingRun] = Field(default_factory=list)
    cycles: list[CycleRecord] = Field(default_factory=list)
    monitors: MonitorSnapshot | None = None
    problems: list[str] = Field(default_factory=list)  # files or lines that could not be read


# ---- reading and writing


def read_jsonl(path: Path, record: type[BaseModel], problems: list[str]) -> list[Any]:
    """The records of a JSONL file; a torn last line (still being written) is skipped, other bad lines noted."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(record.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError) as exc:
            if i == len(lines) - 1 and isinstance(exc, json.JSONDecodeError):
                continue  # being appended right now; the next read has it
            problems.append(f"{path}:{i + 1}: not a {record.__name__} ({_short(exc)}); line skipped")
    return out


def read_training_run(folder: Path, name: str, problems: list[str]) -> TrainingRun:
    metrics, evals, fleet = folder / "metrics.jsonl", folder / "eval.jsonl", folder / "fleet.jsonl"
    return TrainingRun(name=name,
                       steps=read_jsonl(metrics, TrainStep, problems) if metrics.is_file() else [],
                       evals=read_jsonl(evals, EvalPoint, problems) if evals.is_file() else [],
                       fleet=read_jsonl(fleet, FleetPoint, problems) if fleet.is_file() else [],
                       lift=_read_lift(folder / "summary.json", problems))


def _read_lift(path: Path, problems: list[str]) -> HeldOutLift | None:
    """The `lift` of a finished run's summary.json; None while the run has none (or no start eval)."""
    if not path.is_file():
        return None
    try:
        lift = json.loads(path.read_text(encoding="utf-8")).get("lift")
        return HeldOutLift.model_validate(lift) if lift is not None else None
    except (json.JSONDecodeError, AttributeError, ValidationError) as exc:
        problems.append(f"{path}: no readable lift ({_short(exc)}); change left out")
        return None


def cycle_files(directory: Path) -> list[Path]:
    """The cycle records in `directory`: each `cycle-NNNN/report.json`, else its state.json (running)."""
    out = []
    for path in sorted(directory.iterdir()):
        if CYCLE_DIR.fullmatch(path.name) and path.is_dir():
            out += [p for p in (path / name for name in CYCLE_DIR_FILES) if p.is_file()][:1]
    return out


def read_cycle_records(directory: Path, problems: list[str]) -> list[CycleRecord]:
    """The cycles recorded in `directory` (`cycle_files`), by cycle number."""
    out = []
    for path in cycle_files(directory):
        try:
            out.append(CycleRecord.model_validate_json(path.read_bytes()))
        except ValidationError as exc:
            problems.append(f"{path}: not a cycle record ({_short(exc)}); cycle left out")
    return sorted(out, key=lambda c: c.cycle)


def _short(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        return f"{where}: {err['msg']}" if where else err["msg"]
    return str(exc)
