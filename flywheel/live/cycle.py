"""The real-time RL cycle: served answers and users' reactions in, a better production model out, or none.

    flywheel live --config configs/live.toml            # next to a running `flywheel serve`

    users ──> server (production v_p, maybe a candidate arm) ──> LiveStore: completions + events
                 ^                                                  │ read (its own connection)
                 │ POST /v1/admin/deployment                        v
    ┌────────────┴──────────── one cycle, stage by stage ──────────────────────────────────────────────┐
    │ stage    waits for                                          unblocked by                           │
    │ trigger  every_s since the last cycle started, or           the clock, or users' events arriving   │
    │          min_events events since then                                                              │
    │ gather   batch.min_completions trainable completions of     production traffic, and each answer's  │
    │          v_p (feedback windows closed) since the last cut   feedback window closing                │
    │          + up to outcome_wait_s for open background         background sessions' outcome events    │
    │          sessions' outcomes (flywheel/live/sessions.py)     (or their horizon passing)             │
    │ train    -  (family_loo advantages, hinted teachers where   CPU                                    │
    │             follow-ups have words (learner.loss.distill),                                          │
    │             Learner.train_step, register the candidate                                             │
    │             v_c, parent v_p)                                                                       │
    │ gate     -  (v_c and v_p play the eval battery; paired      CPU + sandboxes; fails: "rejected",    │
    │             non-inferiority + behaviour checks; with hints  v_c is never served                    │
    │             distilled, both answer those requests again                                            │
    │             and their behaviour rates are compared:                                                │
    │             flywheel/live/replay.py)                                                               │
    │ deploy   the server loading v_c for candidate_fraction      the admin call returning               │
    │          of sessions                                                                               │
    │ A/B      ab.min_per_arm closed answers on each arm          traffic on both arms + windows closing │
    │          (deploy.max_wait_s without a decision: roll back)                                         │
    │ decide   -  (A/B analysis; a critical monitor alarm on      -                                      │
    │             v_c blocks promotion)                                                                  │
    │ apply    the server switching: promote -> production v_c;   the admin call returning               │
    │          roll back -> production v_p alone                                                         │
    │ orgs     per organization with traffic in the window (orgs.enabled), one after another:          │
    │          gather its on-policy completions (of its adapter, or the base), train its LoRA adapter,   │
    │          gate it on its battery AND the general one, A/B within its traffic (orgs.candidate_       │
    │          fraction; ab.min_per_arm of its answers per arm), promote or roll back it alone           │
    │ report   -  report.json (CycleReport) + report.html                                                │
    └──────────────────────────────────────────────────────────────────────────────────────────────────┘

Organizations (`orgs`, flywheel/live/orgs.py). After the shared model's decision is applied, each
organization that sent completions in the window [since, cutoff) gets its own small cycle: its
trainable completions of the version that served it (its deployed adapter, else the base) are its
on-policy batch; with `orgs.adapter.min_completions` of them its adapter trains (continuing the
deployed one, or fresh on the base), is registered (base, org), and must pass the gate on both the
organization's battery (`orgs.batteries`: a tasks file per organization, read before the first
cycle; `org_gate_tasks` from Python) and the general one; then it is A/B tested against what
served the organization, within its traffic only, and promoted (`Deployment(production=adapter)`
for that organization) or rolled back (its deployment as before). `report.orgs` records each
organization's decision, with a reason for those skipped (too little traffic, no battery). An
organization without an adapter is A/B tested against the base it was served (possibly the
version the shared model just replaced). A cycle killed among its organizations resumes with those
not yet decided (an adapter it had registered for the interrupted one stays in the Registry, unserved).

With deploy.promote_when = "gate" the A/B stage is skipped and every candidate that passes the gate
is promoted: continuous deployment, what a loop without live guardrails does. The reward-hacking
scenarios use it (flywheel/sim/scenario.py); the default waits for the A/B test.

Hinted self-distillation (`learner.loss.distill`, off by default; flywheel/live/hints.py). Where a
user's dissatisfied follow-up said in words what was wrong with an answer, the production version
reads those words as a user message placed before the answer and scores the answer's tokens: the
teacher. The Learner adds a per-token reverse-KL term toward it on the contents of the answer's
tool calls, beside the policy gradient (flywheel/rl/loss.py), for the hints that measurably make
the disliked calls less likely and do not argue against calling tools (docs/feedback-distill.md); the
report's `train` holds distill_loss, distill_tokens, distill_followups, distill_kept and
distill_dropped_share; `distilled` (the state) names the completions whose hints were kept. After
the gate, both versions answer those requests again and the monitors' behaviour rates (tool use,
broken calls, edits) are compared request by request (`replay`, flywheel/live/replay.py): a
significant change in the bad direction rejects the candidate, as a monitor alarm would, before a
user sees it. Organizations' adapters train on the reward alone.

On-policy: the batch holds only completions served by the current production version, so every
token's behaviour logprob is the learner's own starting policy (staleness 0). Completions are cut
by time: cycle n trains on [since, cutoff), and cycle n + 1 starts at that cutoff, so no answer is
trained on twice and none is skipped (except those the reward config drops, counted in the report).

Crash safety. The cycle changes nothing users see until it deploys, and it moves the Registry's
aliases only through the server (`Router.deploy` moves them together with the routing). Each stage
that finishes is written to `run_dir/cycle-NNNN/state.json` (atomically); a restarted `flywheel live`
resumes the unfinished cycle from its last finished stage: a cycle killed before `trained` gathers
and trains again (the same data); one killed after deploying keeps the candidate's A/B arm and keeps
measuring it; a decided one re-applies its decision (idempotent). A candidate registered just before
a kill and not yet written to the state stays in the Registry with no alias and is never served.

Run folder: `cycle-NNNN/{state.json, report.json, report.html}`, `config.json` (resolved, admin key
redacted). A cycle is finished when its `state.json` says stage "done". `flywheel.report` reads these
folders as they are (report.html is its `render_cycle`; `render_report(run_dir)` draws all cycles).

The report (`CycleReport`, schema "flywheel.cycle/1"): cycle number, trigger, versions (production
before and after, candidate), the batch (completions, sessions, families, excluded by reason, the
time window), production's served metrics with confidence intervals, the learner's metrics, the gate
(every check with its paired difference and interval, both versions' eval summaries), the A/B report
(every metric per arm with intervals, the difference with its interval, verdicts), the decision and
its reason, monitor alarms (and which blocked), the monitor series per version and window, and the
seconds each stage took.

Why one file of about 950 lines: the cycle is one loop, read top to bottom as `rl/train.py` is: its
config, how it changes what the server serves, its record, then each stage in order. The stages'
own ideas live in modules of their own (batch.py, gate.py, abtest.py, deploy.py, monitors.py,
sessions.py, orgs.py); what is here is their order and the state that survives a kill.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import httpx
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flywheel.config import include_file, refuse_moved
from flywheel.env.pool import PoolConfig, SandboxPool
from flywheel.env.task import Task, read_tasks
from flywheel.live.abtest import ARMS, ABConfig, ABReport, analyze, compare_rows, metric_rows
from flywheel.live.batch import OnPolicyBatch, on_policy_batch
from flywheel.live.deploy import PINNED, Deployment
from flywheel.live.gate import Contender, Gate, GateConfig, GateRun
from flywheel.live.hints import attach_teachers, followup_hints
from flywheel.live.monitors import Alarm, MetricPoint, Monitor
from flywheel.live.orgs import (
    OrgAdapterConfig,
    OrgGateDecision,
    check_org_id,
    gate_decision,
    register_adapter,
    train_org_adapter,
)
from flywheel.live.records import BACKGROUND, Completion
from flywheel.live.replay import ReplayConfig, ReplayReport, replay_distilled
from flywheel.live.rewards import Reward, RewardDistiller, distill_sessions
from flywheel.live.sessions import (
    GatheredSessions,
    SessionMonitor,
    gather_background,
    watch,
)
from flywheel.live.settings import MOVED_LOOP_KEYS, MOVED_STORE_KEYS, MOVED_WHY, LoopConfig, check_same_loop
from flywheel.live.store import LiveStore
from flywheel.model.adapters import LoraConfig, load_adapted, merged, start_lora
from flywheel.model.engine import EngineConfig, LocalEngine
from flywheel.model.process_engine import start_engine
from flywheel.model.registry import Registry
from flywheel.report import render_cycle
from flywheel.rl.learner import Learner, LearnerConfig
from flywheel.rl.lora import LoraLearner
from flywheel.rl.tracking import Tracker, TrackingConfig
from flywheel.store.files import write_atomic
from flywheel.timing import timed

if TYPE_CHECKING:
    from flywheel.live.server import LiveServer

SCHEMA = "flywheel.cycle/1"
Decision = Literal["promote", "rollback", "rejected", "skipped", "abandoned"]
Stage = Literal["started", "trained", "gated", "deployed", "decided", "done"]
SERVED_METRICS = ("persistence", "dissatisfied", "invalid_calls", "latency", "reward")


# ---- configuration


class TriggerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # A cycle starts when either holds (the first cycle of a run starts at once). Frequent cycles
    # adapt sooner; each still waits for a full batch, so they cannot outrun the traffic.
    every_s: float | None = Field(3600.0, gt=0)
    min_events: int | None = Field(None, ge=1)  # feedback events received since the last cycle started
    poll_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _some_trigger(self) -> TriggerConfig:
        if self.every_s is None and self.min_events is None:
            raise ValueError("the trigger needs every_s or min_events (or both); e.g. trigger.every_s=3600")
        return self


class BatchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Trainable completions of the production version per cycle. Larger batches give lower-variance
    # updates at the cost of waiting longer for traffic (and its feedback windows) every cycle.
    min_completions: int = Field(256, ge=2)
    max_completions: int = Field(4096, ge=2)  # earliest first; the rest start the next cycle's batch
    max_wait_s: float = Field(3600.0, gt=0)  # no full batch by then: the cycle is skipped, nothing changes
    poll_s: float = Field(5.0, gt=0)
    # request_meta key(s) that group the advantage baseline, e.g. ["family", "difficulty"] (flywheel/live/batch.py)
    family_key: str | list[str] = "family"
    # The late-arrival window: once the batch is full, how long the cycle waits for the outcomes of
    # background sessions that started before its cutoff and are still open (no outcome, horizon
    # not reached). Sessions still open then are left out and counted (flywheel/live/sessions.py);
    # they are not trained on later. Longer uses more outcomes, at the cost of a later cycle.
    outcome_wait_s: float = Field(3600.0, ge=0)

    @model_validator(mode="after")
    def _sizes(self) -> BatchConfig:
        if self.max_completions < self.min_completions:
            raise ValueError(f"batch.max_completions {self.max_completions} is below batch.min_completions "
                             f"{self.min_completions}; raise the first or lower the second")
        return self


class DeployConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Share of sessions the candidate answers during its A/B test. Higher reaches ab.min_per_arm
    # sooner, at the cost of more users seeing an unproven version.
    candidate_fraction: float = Field(0.1, gt=0, lt=1)
    max_wait_s: float = Field(7200.0, gt=0)  # an A/B test without a decision by then is rolled back
    poll_s: float = Field(5.0, gt=0)
    # "ab": promote only on an A/B win with no guardrail worse and no blocking alarm.
    # "gate": promote every candidate that passes the gate, without an A/B test (module docstring).
    promote_when: Literal["ab", "gate"] = "ab"


class OrgLoopConfig(BaseModel):
    """Per-organization specialization, after the shared model's decision (module docstring)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    # The LoRA adapter, and how much on-policy traffic of its own an organization needs per cycle.
    adapter: OrgAdapterConfig = Field(default_factory=OrgAdapterConfig)
    # Share of the organization's sessions its candidate adapter answers during its A/B test.
    candidate_fraction: float = Field(0.5, gt=0, lt=1)
    ab: ABConfig | None = None  # None: the shared A/B test's settings
    # Each organization's eval battery: org id -> a JSON-lines file of Task records (`flywheel tasks
    # export --org acme --split eval` writes one for a simulated organization). An organization
    # without a battery is never specialized: its adapter could not be gated on its own tasks.
    batteries: dict[str, Path] = Field(default_factory=dict)

    @field_validator("batteries")
    @classmethod
    def _org_ids(cls, batteries: dict[str, Path]) -> dict[str, Path]:
        for org in batteries:
            check_org_id(org)
        return batteries


def org_batteries(config: OrgLoopConfig, given: dict[str, Sequence[Task]] | None = None) -> dict[str, list[Task]]:
    """Each organization's battery: the tasks files of `config.batteries`, read (a missing file or a
    malformed line raises, naming it), merged with the batteries `given` by a Python caller, which win."""
    batteries = {org: read_tasks(path) for org, path in config.batteries.items()}
    batteries.update({check_org_id(org): list(tasks) for org, tasks in (given or {}).items()})
    return batteries


class LiveConfig(BaseModel):
    """`flywheel live`: where the server is, the live loop's settings it shares with the server
    (where the store and the Registry are, the rewards, the monitors), and each stage's settings.

    `loop_file` / `gate_file` name TOML files of a LoopConfig / GateConfig; a `[loop]` / `[gate]`
    table in the same config overrides their values key by key. The server must be given the same
    loop settings (configs/serve.toml names the same configs/loop.toml): a cycle refuses to start
    against a server whose settings differ. Paths are relative to the working directory."""

    model_config = ConfigDict(extra="forbid")
    loop_file: Path | None = None
    loop: LoopConfig = Field(default_factory=LoopConfig)
    run_dir: Path = Path("runs/cycles")
    server_url: str = "http://127.0.0.1:8000"
    admin_key: str = ""  # a key with the admin scope in the server's [keys]; never written to config.json
    cycles: int = Field(1, ge=0)  # cycles to run; 0: until stopped
    seed: int = 0
    threads: int = Field(2, ge=1)  # torch threads for training and the gate's engines
    gate_file: Path | None = None
    gate: GateConfig = Field(default_factory=GateConfig)
    trigger: TriggerConfig = Field(default_factory=TriggerConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    # Train a LoRA adapter of production instead of all its weights (a pretrained model); the
    # candidate is an adapter version on production's full weights (flywheel/model/adapters.py).
    lora: LoraConfig | None = None
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    ab: ABConfig = Field(default_factory=ABConfig)
    orgs: OrgLoopConfig = Field(default_factory=OrgLoopConfig)
    alarms_block_promotion: bool = True  # a critical alarm on the candidate stops its promotion
    # After the gate, in cycles that distilled hints: both versions answer the distilled requests again
    # and their behaviour rates are compared (flywheel/live/replay.py); an alarm blocks like a monitor's.
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    # What the monitors compare every version with: "production" (this cycle's) or "first" (the
    # production of the run's first cycle, which also catches a slow drift across promotions).
    monitor_baseline: Literal["production", "first"] = "production"
    monitor_lookback_s: float | None = Field(86400.0, gt=0)  # completions monitored; None: all
    engine: EngineConfig = Field(default_factory=EngineConfig)
    pool: PoolConfig = Field(default_factory=lambda: PoolConfig(max_active=16, warm=2))
    # Each cycle's report figures to TensorBoard, W&B, MLflow (flywheel/rl/tracking.py), one tracked
    # run per cycle, stepped by cycle number; all off by default.
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="before")
    @classmethod
    def _include_files(cls, data: Any) -> Any:
        refuse_moved(data, {**MOVED_STORE_KEYS, "store_path": "loop.store.path", "rewards_file": "loop.rewards_file",
                            **MOVED_LOOP_KEYS}, MOVED_WHY)
        return include_file(include_file(data, "loop", "loop_file"), "gate", "gate_file")


# ---- how the cycle changes what the server serves


class DeploymentControl(Protocol):
    def current(self) -> Deployment: ...

    def loop(self) -> dict[str, Any] | None: ...  # the server's LoopConfig.shareable(); None: no server to ask

    def apply(self, deployment: Deployment, note: str) -> None: ...

    def org_current(self, org_id: str) -> Deployment | None: ...  # None: served the shared deployment

    def apply_org(self, org_id: str, deployment: Deployment | None, note: str) -> None: ...


class ServerControl:
    """A LiveServer in this process (tests, benchmarks, demos)."""

    def __init__(self, server: LiveServer):
        self.server = server

    def current(self) -> Deployment:
        return self.server.deployment

    def loop(self) -> dict[str, Any] | None:
        return self.server.config.loop.shareable()

    def apply(self, deployment: Deployment, note: str) -> None:
        self.server.set_deployment(deployment, note)

    def org_current(self, org_id: str) -> Deployment | None:
        return self.server.org_deployment(org_id)

    def apply_org(self, org_id: str, deployment: Deployment | None, note: str) -> None:
        self.server.set_org_deployment(org_id, deployment, note)


class HttpControl:
    """A server elsewhere, through its admin endpoint (`flywheel live` next to `flywheel serve`)."""

    def __init__(self, url: str, admin_key: str, timeout_s: float = 600.0):
        if not admin_key:
            raise ValueError("admin_key is empty; set it to a key with the admin scope in the server's [keys] "
                             "(configs/serve.toml has dev-admin-key)")
        self.url = url.rstrip("/")
        # Long timeout: applying a deployment loads the candidate's weights before it returns.
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s,
                                  headers={"authorization": f"Bearer {admin_key}"})

    def current(self) -> Deployment:
        return Deployment.model_validate(self._call("GET", "/v1/admin/deployment")["deployment"])

    def loop(self) -> dict[str, Any] | None:
        return self._call("GET", "/v1/admin/loop")["loop"]

    def apply(self, deployment: Deployment, note: str) -> None:
        del note  # the admin endpoint records its own note ("admin endpoint")
        self._call("POST", "/v1/admin/deployment", deployment.model_dump_json())

    def org_current(self, org_id: str) -> Deployment | None:
        found = self._call("GET", f"/v1/admin/orgs/{org_id}/deployment")["deployment"]
        return None if found is None else Deployment.model_validate(found)

    def apply_org(self, org_id: str, deployment: Deployment | None, note: str) -> None:
        del note  # recorded as "admin endpoint"
        body = json.dumps({"deployment": None if deployment is None else deployment.model_dump()})
        self._call("PUT", f"/v1/admin/orgs/{org_id}/deployment", body)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: str | None = None) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, content=body)
        except httpx.TransportError as exc:
            raise RuntimeError(f"cannot reach the server at {self.url} ({type(exc).__name__}: {exc}); start "
                               "`flywheel serve` or set server_url") from exc
        if response.status_code != 200:
            raise RuntimeError(f"{method} {self.url}{path} answered {response.status_code}: {response.text[:500]}")
        return response.json()


# ---- the report


class ServedMetric(BaseModel):
    value: float | None  # the rate or mean; None without data
    ci: tuple[float, float] | None  # Wilson (rates) or t (means) at ab.confidence
    n: int


class MonitorSummary(BaseModel):
    baseline_version: int | None
    tests: int
    series: list[MetricPoint]


class OrgCycleReport(BaseModel):
    """One organization's part of a cycle: its adapter trained, gated, A/B tested, decided."""

    org_id: str
    served_version: int  # what served the organization in the window: its adapter, or the shared base
    base: int  # the full checkpoint its adapters apply on
    completions: int  # its trainable on-policy completions in the window
    candidate: int | None = None  # the adapter trained this cycle
    batch: dict[str, Any] | None = None
    train: dict[str, float] | None = None
    gate: OrgGateDecision | None = None  # both batteries' verdict
    org_gate: GateRun | None = None  # the organization's battery
    general_gate: GateRun | None = None  # the general battery
    ab: ABReport | None = None  # within the organization's traffic
    decision: Decision
    reason: str
    deployment_after: Deployment | None = None  # the organization's own deployment after (None: shared)


class CycleState(BaseModel):
    """What a cycle has done so far; written after every stage, so a restart resumes it."""

    cycle: int
    trigger: str
    started_at: float
    production: int
    first_production: int  # production of the run's first cycle (monitor_baseline = "first")
    since: float  # the batch window starts here: the previous cycle's cutoff
    events_at_start: int
    stage: Stage = "started"
    cutoff: float | None = None
    batch: dict[str, Any] | None = None
    served: dict[str, ServedMetric] = Field(default_factory=dict)
    train: dict[str, float] | None = None
    distilled: list[str] = Field(default_factory=list)  # completions whose hints the candidate was distilled on
    candidate: int | None = None
    gate: GateRun | None = None
    replay: ReplayReport | None = None
    deployed_at: float | None = None
    ab: ABReport | None = None
    alarms: list[Alarm] = Field(default_factory=list)
    blocking_alarms: list[Alarm] = Field(default_factory=list)
    monitor: MonitorSummary | None = None
    decision: Decision | None = None
    reason: str = ""
    production_after: int | None = None
    orgs: dict[str, OrgCycleReport] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict)


class CycleReport(BaseModel):
    """One cycle, as report.json holds it (module docstring)."""

    schema_: str = Field(SCHEMA, alias="schema")
    cycle: int
    trigger: str
    started_at: float
    finished_at: float
    production: int  # serving when the cycle started
    candidate: int | None  # trained this cycle (None when skipped)
    production_after: int  # serving when the cycle ended
    decision: Decision
    reason: str
    batch: dict[str, Any] | None  # OnPolicyBatch.summary(), plus since / cutoff (unix seconds)
    served: dict[str, ServedMetric]  # production's traffic in the batch window
    train: dict[str, float] | None  # Learner.train_step metrics
    gate: GateRun | None
    replay: ReplayReport | None = None  # the distilled requests replayed (flywheel/live/replay.py)
    ab: ABReport | None
    alarms: list[Alarm]
    blocking_alarms: list[Alarm]
    monitor: MonitorSummary | None
    orgs: dict[str, OrgCycleReport] = Field(default_factory=dict)  # each organization's decision (orgs.enabled)
    timings: dict[str, float]  # seconds per stage, and total_s

    model_config = ConfigDict(populate_by_name=True)


# ---- the cycle


class LiveCycle:
    """Runs cycles (module docstring); `run` loops over triggers, `run_cycle` does one."""

    def __init__(self, config: LiveConfig, control: DeploymentControl, log: Callable[[str], None] = print,
                 gate_tasks: Sequence[Task] | None = None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, org_gate_tasks: dict[str, Sequence[Task]] | None = None):
        """`gate_tasks` replaces the battery's tasks (a world whose tasks are no procedural family).
        `org_gate_tasks`: each organization's own battery (its conventions' tasks), over those of
        `orgs.batteries` (read here, so a bad file stops the cycle before it starts); an organization
        without one is not specialized (orgs.enabled).
        `clock` / `sleep` are what gathering reads the time with and waits with: a simulation whose
        store holds hours of timestamps passes its own, so no test sleeps for hours."""
        self.config = config
        self.clock, self.sleep = clock, sleep
        self.control = control
        self.log = log
        self.gate_tasks = list(gate_tasks) if gate_tasks is not None else None
        self.org_gate_tasks = org_batteries(config.orgs, org_gate_tasks)
        loop = config.loop
        self.distiller = RewardDistiller(loop.rewards)
        self.gate = Gate(config.gate)
        self.monitor = Monitor(loop.monitor)
        self.session_monitor = SessionMonitor(loop.session_monitor)
        if loop.store.url is None and not loop.store.path.is_file():
            raise ValueError(f"no live store at {loop.store.path}; start `flywheel serve` first (it writes "
                             "loop.store.path) or set loop.store.path to its file")
        if loop.store.registry_url is None and not (loop.store.registry_root / "registry.sqlite").is_file():
            raise ValueError(f"no registry at {loop.store.registry_root}; run `flywheel bootstrap` or set "
                             "loop.store.registry_root")
        check_same_loop(loop, control.loop() if control is not None else None)

    def _store(self) -> LiveStore:
        return LiveStore(self.config.loop.store.location)

    def _registry(self) -> Registry:
        return Registry(self.config.loop.store.registry_root, url=self.config.loop.store.registry_url)

    def run(self, cycles: int | None = None) -> list[CycleReport]:
        """Wait for each trigger and run a cycle, `cycles` times (config.cycles; 0: forever)."""
        total = self.config.cycles if cycles is None else cycles
        reports: list[CycleReport] = []
        while total == 0 or len(reports) < total:
            trigger = "resumed" if self._unfinished() is not None else self.wait_for_trigger()
            reports.append(self.run_cycle(trigger))
        return reports

    def wait_for_trigger(self) -> str:
        """Block until the schedule or the event count says a cycle is due; returns which one."""
        trigger, last = self.config.trigger, self._last_state()
        if last is None:
            return "first"
        with self._store() as store:
            while True:
                if trigger.every_s is not None and time.time() - last.started_at >= trigger.every_s:
                    return "schedule"
                if trigger.min_events is not None and store.count_events() - last.events_at_start >= trigger.min_events:
                    return "events"
                time.sleep(trigger.poll_s)

    def run_cycle(self, trigger: str = "manual") -> CycleReport:
        """One cycle; resumes the run folder's unfinished cycle if there is one."""
        torch.set_num_threads(self.config.threads)
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        with self._registry() as registry, self._store() as store:
            state = self._unfinished()
            if state is None:
                state = self._start(trigger, store)
            else:
                self.log(f"cycle {state.cycle}: resuming after stage {state.stage!r}")
                self._check_still_current(state)
            while state.stage != "done":
                self._advance(state, registry, store)
                if state.stage == "done":
                    # The report before the state says done: killed in between, the rerun re-applies
                    # the decision (idempotent) and writes it again.
                    report = self._report(state)
                self._save(state)
        self.log(f"cycle {state.cycle}: {report.decision} ({report.reason}); production v{report.production_after}, "
                 f"{report.timings['total_s']:.0f} s")
        return report

    # ---- stages

    def _advance(self, state: CycleState, registry: Registry, store: LiveStore) -> None:
        """Do the stage after `state.stage` and record it in `state`."""
        if state.decision is not None and state.stage not in ("decided", "done"):
            state.stage = "decided"  # skipped, rejected, abandoned, or promoted by the gate: apply and report
        elif state.stage == "started":
            self._gather_and_train(state, registry, store)
        elif state.stage == "trained":
            with timed(state.timings, "gate_s"):
                self._run_gate(state, registry, store)
        elif state.stage == "gated":
            with timed(state.timings, "deploy_s"):
                self._deploy(state)
        elif state.stage == "deployed":
            with timed(state.timings, "ab_s"):
                self._measure(state, store)
        elif state.stage == "decided":
            with timed(state.timings, "apply_s"):
                self._apply(state, store)
            if self.config.orgs.enabled and state.cutoff is not None and state.decision != "abandoned":
                with timed(state.timings, "orgs_s"):
                    self._orgs(state, registry, store)
            state.stage = "done"

    def _gather_and_train(self, state: CycleState, registry: Registry, store: LiveStore) -> None:
        with timed(state.timings, "gather_s"):
            gathered = self._gather(state, store)
        if gathered is None:
            return
        batch, served = gathered
        state.served = served
        with timed(state.timings, "train_s"):
            self._train(state, registry, batch, store)

    def _train(self, state: CycleState, registry: Registry, batch: OnPolicyBatch, store: LiveStore) -> None:
        torch.manual_seed(self.config.seed * 100_003 + state.cycle)
        ref = registry.load(state.production)[0] if self.config.learner.loss.kl_coef > 0 else None
        base = None  # with lora: the full version the candidate adapter applies on
        if self.config.lora is None:
            model, tokenizer = registry.load(state.production)
            learner = Learner(model.train(), self.config.learner, ref_model=ref)  # policy 0 = v{production}
        else:
            adapter, tokenizer, base_checkpoint = start_lora(registry, state.production, self.config.lora)
            learner, base = LoraLearner(adapter, self.config.learner, ref_model=ref), base_checkpoint.version
        hinted: dict[str, float] = {}
        distill = self.config.learner.loss.distill
        if distill.weight > 0:  # the teacher is the version that served the batch: the learner's weights now
            hints = followup_hints(store, batch.completions, distill.hint_at)
            hinted = attach_teachers(learner.model.train(), tokenizer, batch, hints, distill,
                                     self.config.learner.temperature)
        state.distilled = [c.id for t, c in zip(batch.trajectories, batch.completions, strict=True)
                           if t.teacher_logprobs is not None]
        metrics = learner.train_step(batch.trajectories, batch.advantages())
        state.train = {k: float(v) for k, v in metrics.items()} | hinted
        if metrics["optimizer_steps"] == 0:
            state.decision, state.reason = "rejected", "the learner took no step (non-finite loss or gradients)"
            return
        checkpoint = registry.register(
            learner.model.eval() if base is None else learner.adapter.eval(), tokenizer, parent=state.production,
            base=base,
            metrics={"live_cycle": float(state.cycle), "batch_completions": float(len(batch.trajectories)),
                     "batch_reward_mean": batch.summary()["reward_mean"], "train_loss": float(metrics["loss"])},
            note=f"live cycle {state.cycle}: {len(batch.trajectories)} completions of v{state.production}")
        state.candidate, state.stage = checkpoint.version, "trained"
        self.log(f"cycle {state.cycle}: trained v{state.candidate} from v{state.production} on "
                 f"{len(batch.trajectories)} completions (reward {batch.summary()['reward_mean']:+.3f}, "
                 f"loss {metrics['loss']:.4f}, {metrics['seconds']:.1f} s)")

    def _gather(self, state: CycleState, store: LiveStore) -> tuple[OnPolicyBatch, dict[str, ServedMetric]] | None:
        """Wait for a full on-policy batch, then up to batch.outcome_wait_s for the outcomes of its
        background sessions; None (and the state says skipped) if no full batch came in time."""
        cfg = self.config.batch
        deadline = self.clock() + cfg.max_wait_s
        full_at: float | None = None  # when the batch was first full: its cutoff is frozen from then
        cutoff = 0.0
        while True:
            now = self.clock()
            if full_at is None:
                cutoff = now - self.config.loop.rewards.feedback_window_s
            served, rewards, background = self._on_policy(state, store, cutoff, now)
            batch = self._batch(state, served, rewards)
            if full_at is None and len(batch.trajectories) >= cfg.min_completions:
                full_at = now
            if full_at is not None:
                if not background.left_out.get("open") or now >= full_at + cfg.outcome_wait_s:
                    break
                self.log(f"cycle {state.cycle}: waiting for {background.left_out['open']} background sessions' "
                         f"outcomes ({now - full_at:.0f}/{cfg.outcome_wait_s:.0f} s)")
            elif now > deadline:
                state.decision = "skipped"
                state.reason = (f"{len(batch.trajectories)} trainable completions of v{state.production} after "
                                f"{cfg.max_wait_s:.0f} s; batch.min_completions is {cfg.min_completions}")
                if batch.excluded.get("other_temperature"):
                    state.reason += (f"; {batch.excluded['other_temperature']} were sampled at another temperature "
                                     f"than learner.temperature = {self.config.learner.temperature}: set it to the "
                                     "temperature users sample at")
                return None
            else:
                self.log(f"cycle {state.cycle}: gathering, {len(batch.trajectories)}/{cfg.min_completions} "
                         f"trainable completions of v{state.production}")
            self.sleep(cfg.poll_s)
        if len(batch.trajectories) > cfg.max_completions:
            # Keep the earliest max_completions; the next cycle starts at the first answer left out.
            last = batch.completions[cfg.max_completions - 1]
            cutoff = next(c.created_at for c in served if c.created_at > last.created_at)
            served, rewards, background = self._on_policy(state, store, cutoff, now)
            batch = self._batch(state, served, rewards)
        if background.left_out:
            self.log(f"cycle {state.cycle}: background sessions left out: "
                     + ", ".join(f"{n} {why}" for why, n in sorted(background.left_out.items())))
        state.cutoff = cutoff
        state.batch = {**batch.summary(), "since": state.since, "cutoff": cutoff, "background": background.summary()}
        return batch, self._served_metrics(served, rewards)

    def _on_policy(self, state: CycleState, store: LiveStore, cutoff: float,
                   now: float) -> tuple[list[Completion], dict[str, Reward], GatheredSessions]:
        """Production's user-routed completions in [since, cutoff) with their rewards: the interactive
        ones, and those of the background sessions that started there and are resolved (sessions.py)."""
        with store.snapshot():  # the completions and the events that reward them, as of one instant
            interactive = [c for c in store.completions(version=state.production, start=state.since, end=cutoff)
                           if c.arm != PINNED and c.session_kind != BACKGROUND]
            rewards = self._distill(store, interactive, now)
            background = gather_background(store, self.distiller, state.production, state.since, cutoff, now)
        served = sorted([*interactive, *background.completions], key=lambda c: (c.created_at, c.id))
        return served, {**rewards, **background.rewards}, background

    def _batch(self, state: CycleState, served: Sequence[Completion], rewards: dict[str, Reward]) -> OnPolicyBatch:
        return on_policy_batch(served, [rewards[c.id] for c in served], state.production,
                               self.config.batch.family_key, self.config.learner.temperature)

    def _gate_engine(self, registry: Registry, model, version: int):
        """A LocalEngine on `model`; with engine.backend = "vllm", vLLM servers of its own on the version's folder."""
        if self.config.engine.backend == "vllm":
            return start_engine(None, self.config.engine, version, checkpoint=registry.get(version).path)
        return LocalEngine(model, self.config.engine, version=version)

    def _run_gate(self, state: CycleState, registry: Registry, store: LiveStore) -> None:
        assert state.candidate is not None
        cand_model, cand_tok = registry.load(state.candidate)
        prod_model, prod_tok = registry.load(state.production)
        with self._gate_engine(registry, cand_model, state.candidate) as cand_engine, \
                self._gate_engine(registry, prod_model, state.production) as prod_engine, \
                SandboxPool(self.config.pool) as pool:
            run = self.gate.run(Contender(cand_engine, cand_tok, state.candidate),
                                Contender(prod_engine, prod_tok, state.production), pool, self.gate_tasks)
            distilled = [c for i in state.distilled if (c := store.completion(i)) is not None]
            if distilled and self.config.replay.enabled:
                state.replay = replay_distilled(cand_engine, prod_engine, cand_tok, distilled, self.config.replay,
                                                self.config.learner.temperature)
        state.gate, state.stage = run, "gated"
        checks = ", ".join(f"{name} {'ok' if r.passed else 'FAIL'}" for name, r in run.decision.checks.items())
        self.log(f"cycle {state.cycle}: gate {'passed' if run.decision.passed else 'failed'} on {run.tasks} tasks "
                 f"in {run.seconds:.1f} s ({checks})")
        if state.replay is not None:
            self.log(f"cycle {state.cycle}: replayed {state.replay.requests} distilled requests x "
                     f"{state.replay.samples}: {state.replay.describe()}")
        blocking = state.replay.blocking if state.replay is not None and self.config.alarms_block_promotion else []
        if not run.decision.passed:
            state.decision = "rejected"
            state.reason = "gate: " + "; ".join(f"{name}: {run.decision.checks[name].reason}"
                                                for name in run.decision.failed)
        elif blocking:
            state.decision = "rejected"
            state.reason = (f"replay of the {state.replay.requests} distilled requests: "
                            + state.replay.describe(blocking))
        elif self.config.deploy.promote_when == "gate":
            state.decision, state.reason = "promote", "passed the gate (deploy.promote_when = gate: no A/B test)"

    def _deploy(self, state: CycleState) -> None:
        assert state.candidate is not None
        fraction = self.config.deploy.candidate_fraction
        self.control.apply(Deployment(production=state.production, candidate=state.candidate,
                                      candidate_fraction=fraction),
                                      f"cycle {state.cycle}: A/B test of v{state.candidate}")
        state.deployed_at, state.stage = time.time(), "deployed"
        self.log(f"cycle {state.cycle}: v{state.candidate} serves {fraction:.0%} of sessions next to "
                 f"v{state.production}")

    def _measure(self, state: CycleState, store: LiveStore) -> None:
        """Wait for the A/B test to decide (or time out), then decide with the monitors."""
        assert state.candidate is not None and state.deployed_at is not None
        versions = {state.production, state.candidate}
        deadline = state.deployed_at + self.config.deploy.max_wait_s
        while True:
            now = time.time()
            with store.snapshot():
                arms = [c for c in store.completions(start=state.deployed_at)
                        if c.version in versions and c.arm in ARMS]
                rewards = self._distill(store, arms, now)
            ab = analyze(arms, [rewards[c.id] for c in arms], self.config.ab)
            if ab.decision != "wait" or now > deadline:
                break
            self.log(f"cycle {state.cycle}: A/B waiting ({ab.reason})")
            time.sleep(self.config.deploy.poll_s)
        state.ab = ab
        self._watch(state, store)
        blocking = state.blocking_alarms if self.config.alarms_block_promotion else []
        if ab.decision == "wait":
            state.decision = "rollback"
            state.reason = (f"no A/B decision within deploy.max_wait_s = {self.config.deploy.max_wait_s:.0f} s: "
                            f"{ab.reason}")
        elif ab.decision == "promote" and blocking:
            state.decision = "rollback"
            state.reason = f"{ab.reason}, but monitor alarms block it: " + ", ".join(
                f"{a.metric} {a.baseline_value:.3f} -> {a.value:.3f} (p={a.p_value:.1e})" for a in blocking)
        else:
            state.decision, state.reason = ab.decision, f"A/B: {ab.reason}"
        state.stage = "decided"

    def _apply(self, state: CycleState, store: LiveStore) -> None:
        """Make the decision true on the server (idempotent), then finish the report."""
        if state.monitor is None:  # decided without an A/B stage: monitors still report
            self._watch(state, store)
        promote = state.decision == "promote" and state.candidate is not None
        after = state.candidate if promote else state.production
        assert after is not None
        if state.decision != "abandoned":
            current = self.control.current()
            if current.production != after or current.candidate is not None:
                self.control.apply(Deployment(production=after),
                                   f"cycle {state.cycle}: {state.decision} v{state.candidate}")
        state.production_after = after

    # ---- per-organization specialization (orgs.enabled; flywheel/live/orgs.py)

    def _orgs(self, state: CycleState, registry: Registry, store: LiveStore) -> None:
        """Each organization with traffic in the window, one after another; each result is saved
        as it is decided, so a resumed cycle does not repeat an organization it finished."""
        assert state.cutoff is not None
        orgs = sorted({c.org_id for c in store.completions(start=state.since, end=state.cutoff) if c.org_id})
        for org in orgs:
            if org in state.orgs:
                continue  # decided before a restart
            result = self._org_cycle(state, org, registry, store)
            state.orgs[org] = result
            self._save(state)
            self.log(f"cycle {state.cycle}: organization {org}: {result.decision} ({result.reason})")

    def _org_cycle(self, state: CycleState, org: str, registry: Registry, store: LiveStore) -> OrgCycleReport:
        """Gather the organization's on-policy traffic, train its adapter, gate it on its battery and
        the general one, A/B test it within its traffic, promote or roll back; the organization only."""
        cfg = self.config.orgs
        assert state.cutoff is not None
        before = self.control.org_current(org)
        served = before.production if before is not None else state.production
        checkpoint = registry.get(served)
        base = checkpoint.base if checkpoint.base is not None else served
        now = self.clock()
        with store.snapshot():
            interactive = [c for c in store.completions(version=served, start=state.since, end=state.cutoff,
                                                        org_id=org) if c.arm != PINNED and c.session_kind != BACKGROUND]
            rewards = self._distill(store, interactive, now)
            background = gather_background(store, self.distiller, served, state.since, state.cutoff, now, org_id=org)
        completions = sorted([*interactive, *background.completions], key=lambda c: (c.created_at, c.id))
        rewards |= background.rewards
        batch = on_policy_batch(completions, [rewards[c.id] for c in completions], served,
                                self.config.batch.family_key, self.config.learner.temperature)
        result = OrgCycleReport(org_id=org, served_version=served, base=base, completions=len(batch.trajectories),
                                batch=batch.summary(), decision="skipped", reason="", deployment_after=before)
        if len(batch.trajectories) < cfg.adapter.min_completions:
            result.reason = (f"{len(batch.trajectories)} trainable completions of v{served} in the window; "
                             f"orgs.adapter.min_completions is {cfg.adapter.min_completions}")
            return result
        if org not in self.org_gate_tasks:
            result.reason = f"no eval battery for {org!r}: set orgs.batteries.{org} to its tasks file to specialize it"
            return result

        # train: its current adapter continues (on-policy: it served the batch), else a fresh one
        torch.manual_seed(self.config.seed * 100_003 + state.cycle)
        base_model, tokenizer = registry.load(base)
        current = load_adapted(registry, served, trainable=True)[0] if checkpoint.base is not None else None
        adapter, metrics = train_org_adapter(base_model, batch, self.config.learner, cfg.adapter, current)
        result.train = metrics
        if metrics["optimizer_steps"] == 0:
            result.decision, result.reason = "rejected", "the learner took no step (non-finite loss or gradients)"
            return result
        candidate = register_adapter(registry, adapter, tokenizer, base=base, org_id=org, parent=served,
                                     metrics={"live_cycle": float(state.cycle), "train_loss": float(metrics["loss"])},
                                     note=f"live cycle {state.cycle}: {org} on {len(batch.trajectories)} completions "
                                          f"of v{served}").version
        result.candidate = candidate

        # gate: both batteries, each paired against what serves the organization now
        served_model = merged(load_adapted(registry, served)[0]) if checkpoint.base is not None else base_model
        with LocalEngine(merged(adapter), self.config.engine, version=candidate) as cand_engine, \
                LocalEngine(served_model, self.config.engine, version=served) as served_engine, \
                SandboxPool(self.config.pool) as pool:
            contenders = (Contender(cand_engine, tokenizer, candidate), Contender(served_engine, tokenizer, served))
            result.org_gate = self.gate.run(*contenders, pool, self.org_gate_tasks[org])
            result.general_gate = self.gate.run(*contenders, pool, self.gate_tasks)
        result.gate = gate_decision(result.org_gate, result.general_gate)
        if not result.gate.passed:
            result.decision, result.reason = "rejected", "gate: " + result.gate.reason
            return result

        # A/B within the organization's traffic, then its own decision
        self.control.apply_org(org, Deployment(production=served, candidate=candidate,
                                               candidate_fraction=cfg.candidate_fraction),
                               f"cycle {state.cycle}: A/B test of {org}'s v{candidate}")
        deployed_at, versions = time.time(), {served, candidate}
        ab_config = cfg.ab or self.config.ab
        while True:
            now = time.time()
            with store.snapshot():
                arms = [c for c in store.completions(start=deployed_at, org_id=org)
                        if c.version in versions and c.arm in ARMS]
                arm_rewards = self._distill(store, arms, now)
            result.ab = analyze(arms, [arm_rewards[c.id] for c in arms], ab_config)
            if result.ab.decision != "wait" or now > deployed_at + self.config.deploy.max_wait_s:
                break
            time.sleep(self.config.deploy.poll_s)
        if result.ab.decision == "promote":
            result.decision, result.reason = "promote", f"A/B within {org}: {result.ab.reason}"
            result.deployment_after = Deployment(production=candidate)
        else:
            result.decision = "rollback"
            result.reason = (f"A/B within {org}: {result.ab.reason}" if result.ab.decision == "rollback" else
                             f"no A/B decision within deploy.max_wait_s = {self.config.deploy.max_wait_s:.0f} s: "
                             f"{result.ab.reason}")
            result.deployment_after = before  # what served it before: its previous adapter, or the shared one
        self.control.apply_org(org, result.deployment_after, f"cycle {state.cycle}: {result.decision} {org}'s "
                                                             f"v{candidate}")
        return result

    # ---- what the stages share

    def _distill(self, store: LiveStore, completions: Sequence[Completion], now: float) -> dict[str, Reward]:
        return distill_sessions(self.distiller, store, completions, now)

    def served(self, store: LiveStore, completions: Sequence[Completion], now: float) -> dict[str, ServedMetric]:
        """The A/B metrics of `completions` (e.g. one version's answers in a measurement window), with
        intervals, under this loop's reward config, as a report's `served` has them."""
        return self._served_metrics(completions, self._distill(store, completions, now))

    def _served_metrics(self, completions: Sequence[Completion], rewards: dict[str, Reward]) -> dict[str, ServedMetric]:
        """The A/B metrics of one version's traffic, with intervals (the same definitions as the A/B test)."""
        pairs = [(c, rewards[c.id]) for c in completions]
        out = {}
        for name in SERVED_METRICS:
            rows = metric_rows(name, pairs, self.config.ab.edit_tools)
            m = compare_rows(name, rows, rows, self.config.ab)
            out[name] = ServedMetric(value=m.production, ci=m.production_ci, n=len(rows))
        return out

    def _watch(self, state: CycleState, store: LiveStore) -> None:
        """Run the monitors, per answer and per session (`sessions.watch`, the dashboard's too), over
        the lookback window; record alarms and which of them block the candidate."""
        wanted = state.first_production if self.config.monitor_baseline == "first" else state.production
        watched = watch(store, self.distiller, self.monitor, self.session_monitor, time.time(),
                        self.config.monitor_lookback_s, wanted)
        report, baseline = watched.report, watched.baseline_version
        state.alarms = report.alarms
        state.blocking_alarms = report.blocking(state.candidate) if state.candidate is not None else []
        state.monitor = MonitorSummary(baseline_version=baseline, tests=report.tests, series=report.series)
        for alarm in report.alarms:
            self.log(f"cycle {state.cycle}: ALARM ({alarm.severity}) v{alarm.version} {alarm.metric} "
                     f"{alarm.baseline_value:.3f} -> {alarm.value:.3f} (n={alarm.n}, p={alarm.p_value:.1e}, "
                     f"vs {alarm.baseline})")

    # ---- the run folder

    def _cycle_dir(self, cycle: int) -> Path:
        return self.config.run_dir / f"cycle-{cycle:04d}"

    def _states(self) -> list[CycleState]:
        dirs = sorted(p for p in self.config.run_dir.glob("cycle-*") if (p / "state.json").is_file())
        return [CycleState.model_validate_json((p / "state.json").read_text()) for p in dirs]

    def _last_state(self) -> CycleState | None:
        states = self._states()
        return states[-1] if states else None

    def _unfinished(self) -> CycleState | None:
        last = self._last_state()
        return last if last is not None and last.stage != "done" else None

    def _start(self, trigger: str, store: LiveStore) -> CycleState:
        states = self._states()
        previous = states[-1] if states else None
        production = self.control.current().production
        since = 0.0
        if previous is not None:
            since = previous.cutoff if previous.cutoff is not None else previous.since
        state = CycleState(cycle=previous.cycle + 1 if previous else 1, trigger=trigger, started_at=time.time(),
                           production=production, first_production=states[0].production if states else production,
                           since=since, events_at_start=store.count_events())
        self._save(state)
        self.log(f"cycle {state.cycle}: started ({trigger}), production v{production}")
        return state

    def _check_still_current(self, state: CycleState) -> None:
        """A resumed cycle whose production was replaced meanwhile (by hand) is abandoned, untouched."""
        production = self.control.current().production
        if state.stage != "decided" and production != state.production:
            state.decision = "abandoned"
            state.reason = (f"production changed from v{state.production} to v{production} while the cycle was "
                            "stopped; the deployment is left as it is")
            state.production = production

    def _save(self, state: CycleState) -> None:
        folder = self._cycle_dir(state.cycle)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / "state.json", state.model_dump_json(indent=2))

    def _report(self, state: CycleState) -> CycleReport:
        assert state.decision is not None and state.production_after is not None
        state.timings["total_s"] = sum(v for k, v in state.timings.items() if k != "total_s")
        report = CycleReport(
            cycle=state.cycle, trigger=state.trigger, started_at=state.started_at, finished_at=time.time(),
            production=state.production, candidate=state.candidate, production_after=state.production_after,
            decision=state.decision, reason=state.reason, batch=state.batch, served=state.served, train=state.train,
            gate=state.gate, replay=state.replay, ab=state.ab, alarms=state.alarms,
            blocking_alarms=state.blocking_alarms, monitor=state.monitor, orgs=state.orgs, timings=state.timings)
        folder = self._cycle_dir(state.cycle)
        write_atomic(folder / "report.json", report.model_dump_json(indent=2, by_alias=True))
        write_atomic(folder / "report.html", render_cycle(report.model_dump(mode="json", by_alias=True),
                                                       title=f"flywheel cycle {state.cycle}: {state.decision}"))
        if self.config.tracking.enabled:
            tracking = self.config.tracking
            name = f"{tracking.run_name or self.config.run_dir.resolve().name}-cycle-{state.cycle:04d}"
            params = self.config.model_dump(mode="json", exclude={"admin_key"})
            with Tracker(tracking.model_copy(update={"run_name": name}), self.config.run_dir, params) as tracker:
                tracker.log(report.model_dump(mode="json", by_alias=True), state.cycle)
        return report


def load_report(path: str | Path) -> CycleReport:
    return CycleReport.model_validate_json(Path(path).read_text())
