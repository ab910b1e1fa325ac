"""Simulated users: a population with different habits who use the served model as an editor would.

    population = load_config(Population, "configs/population.toml")
    with SandboxPool() as pool:
        stats = run_population("http://127.0.0.1:8000", "inference-key", population, n_sessions=100, pool=pool,
                               events_key="events-key")
    print(stats.model_dump_json(exclude={"session_results"}))

One session is one user working on one task, through the official `openai` client:

    user ──chat.completions(messages, tools, metadata)──> server ──answer (id = completion id)
      tool calls?  run them with flywheel's tools in the user's own sandbox, send the results back
                   as `role: tool` messages (tool_call_id) in the next request; an invalid call runs
                   nothing and is answered with its error, as the episode runner does
                   an edit ran ──> edit_applied(completion)
      finish?      grade the workspace with the hidden tests; passing: done. Failing: sometimes
                   (followup_propensity) say what went wrong ──> followup(dissatisfied, text), go on
      words only?  a question on an ambiguous task (first time): Task.answer_question, followup(satisfied);
                   anything else (a needless question, a non-answer): always followup(dissatisfied)
                   and "please just do it"
    a follow-up's text is the user's next message: the wrong file, a missed test run, a broken tool
    call, an unneeded question, drawn from the episode (flywheel/sim/feedback.py), vague or wrong
    in a profile's configured share
      patience (max requests) used up ──> the user walks away
    end: grade the final workspace ──> edit_persisted | edit_reverted for every completion whose edit
         ran (a failing edit is reverted with probability revert_strictness, else kept unnoticed),
         thumbs (sometimes), session_end {outcome: success | unhappy | abandoned}

Outcomes: `success` when the final workspace passes the hidden tests; `unhappy` when it fails after
the agent said it was done (called finish); `abandoned` when the user ran out of patience, or the
server answered with an error (the session ends there; counted in `server_errors`).

What the server learns, and how. Each request carries the session id (`extra_body` session_id),
the user id (`user`) and `metadata` = request_meta: family, ambiguous, task_id, difficulty, profile
(what the monitors group by). Whether the code ended up working is only known after the last
request, and a served completion is never rewritten, so it travels as an event payload:
`session_end` and the `edit_*` outcome events carry `{"tests_passed": bool}`.
`flywheel.live.monitors.label_tests_passed` copies it into the session's completions'
request_meta["tests_passed"] (what the monitors read); the reward never looks at it.

Background agents (`kind = "background"`): the user gives one instruction and leaves; the agent
works for up to `patience` turns with no user in between (tool results go back, a question is
answered "work on your own" and counted, never a follow-up event), and the requests carry
metadata session_kind = "background". The user judges the whole result at the end, hours later:
one `outcome` event, merged (or ci_green) when the final workspace passes the hidden tests,
reverted when it fails with an edit, abandoned when nothing was edited. Its time is the session's
end + a delay drawn from `outcome_delay_s` (hours, simulated): with `deferred` given to
`run_population`, the outcome is not sent but kept there with the time it is due, and the driver
sends it when its simulated clock reaches that time (`release_due`), so some outcomes arrive after
the next cycle started, and nothing sleeps for hours.

Departures from a real editor: one task per session; edits are judged when the session ends (a
real client reports edit_persisted after a horizon); every task fails its hidden tests untouched
(tests/sim/test_expert.py checks it), so an untouched workspace is not graded. Events go through
the SDK (`EventClient`) over HTTP; nothing here talks to the store.

Only the CLI demo, benchmarks and tests import this module; the core never does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import openai
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flywheel.api.events import EventType
from flywheel.client import EventClient
from flywheel.env.families import KNOWN_FAMILIES, generate
from flywheel.env.grading import GradeConfig, grade
from flywheel.env.pool import SandboxPool
from flywheel.env.sandbox import SandboxError, Snapshot
from flywheel.env.task import Split, Task
from flywheel.env.tools import Toolbox
from flywheel.env.toolspec import ToolCall, validate_arguments
from flywheel.live.rewards import EDIT_TOOLS
from flywheel.model.chat import SYSTEM_PROMPT, tool_schemas
from flywheel.sim.feedback import Trail, maybe_hostile, words_for_failing_tests, words_for_needless_question
from flywheel.sim.orgs import HouseRules

log = logging.getLogger(__name__)

WORK_ALONE = "I am not at my desk; work on your own, I will review the result."


class UserProfile(BaseModel):
    """One kind of user: how long they keep at it, how they react, what they work on."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,40}$")
    weight: float = Field(1.0, gt=0)  # share of the population's users with these habits
    patience: int = Field(6, ge=1)  # requests per session before walking away (session_end abandoned)
    # P(writing a dissatisfied follow-up when the agent says it is done and the tests fail). The
    # rest stop there (unhappy). Needless questions always get one, whatever this is.
    followup_propensity: float = Field(0.5, ge=0, le=1)
    thumbs_propensity: float = Field(0.1, ge=0, le=1)  # P(a thumbs up/down at the end of a session)
    # Shares of dissatisfied follow-ups whose words are vague ("still broken") or wrong (blame a file
    # the fix does not touch), as real users write; the rest say what went wrong. Higher makes the
    # text a noisier teaching signal; the reward, which reads only `dissatisfied`, is unchanged.
    followup_vague_share: float = Field(0.15, ge=0, le=1)
    followup_wrong_share: float = Field(0.05, ge=0, le=1)
    # Share of dissatisfied follow-ups that are an attack instead (flywheel/sim/feedback.py HOSTILE:
    # prompt injection, "stop using tools"): the hostile-hint scenario's population. 0 for real users.
    followup_hostile_share: float = Field(0.0, ge=0, le=1)
    # P(reverting an edit whose workspace fails the hidden tests). Below 1, some failing edits are
    # kept unnoticed (edit_persisted): label noise the reward has to live with.
    revert_strictness: float = Field(1.0, ge=0, le=1)
    families: dict[str, float] = Field(default_factory=lambda: {"bugfix": 1.0, "implement": 1.0, "crossfile": 1.0,
                                                                 "ambiguous": 1.0})
    think_time_s: tuple[float, float] = (0.0, 0.0)  # uniform pause before each request (reading, typing)
    # "background": a long agent session judged by one outcome hours later (module docstring).
    kind: Literal["interactive", "background"] = "interactive"
    # Background: seconds from the session's end to its outcome, uniform in [low, high] (simulated).
    outcome_delay_s: tuple[float, float] = (3600.0, 4 * 3600.0)
    org_id: str = ""  # the organization its requests name in metadata (a keyed deployment sets it by key)
    # Users of an organization with its own conventions (flywheel/sim/orgs.py): every task they draw
    # is rewritten into that codebase (`HouseRules.adapt`: its helper, logging call, test layout) and
    # graded by its rules, and their requests name its org_id. Only bugfix tasks can be adapted, so
    # such a profile's families are bugfix alone. A fixed workload (`tasks` of run_population) is
    # taken as given, org id included.
    house_rules: HouseRules | None = None

    @model_validator(mode="after")
    def _shares(self) -> UserProfile:
        if self.followup_vague_share + self.followup_wrong_share > 1:
            raise ValueError(f"profile {self.name}: followup_vague_share + followup_wrong_share is past 1; lower one")
        return self

    @model_validator(mode="after")
    def _organization(self) -> UserProfile:
        if self.house_rules is None:
            return self
        if self.org_id not in ("", self.house_rules.org_id):
            raise ValueError(f"profile {self.name}: org_id {self.org_id!r} differs from its house_rules.org_id "
                             f"{self.house_rules.org_id!r}; drop org_id (the house rules name the organization)")
        other = sorted(f for f, w in self.families.items() if w > 0 and f != "bugfix")
        if other:
            raise ValueError(f"profile {self.name}: house rules adapt bugfix tasks only, but its families include "
                             f"{other}; set families = {{bugfix = 1.0}}")
        self.org_id = self.house_rules.org_id
        return self

    @field_validator("families")
    @classmethod
    def _families(cls, families: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(families) - set(KNOWN_FAMILIES))
        if unknown:
            raise ValueError(f"unknown task families {unknown}; known: {list(KNOWN_FAMILIES)}")
        if any(w < 0 for w in families.values()) or sum(families.values()) <= 0:
            raise ValueError("family weights must be >= 0 with a positive sum, e.g. {bugfix = 1.0}")
        return families

    @field_validator("think_time_s", "outcome_delay_s")
    @classmethod
    def _think_time(cls, bounds: tuple[float, float]) -> tuple[float, float]:
        if not 0 <= bounds[0] <= bounds[1]:
            raise ValueError(f"bounds must be [low, high] with 0 <= low <= high, got {list(bounds)}")
        return bounds


def _default_profiles() -> list[UserProfile]:
    return [UserProfile(name="patient", patience=8, followup_propensity=0.8, thumbs_propensity=0.2),
            UserProfile(name="impatient", patience=3, followup_propensity=0.2, thumbs_propensity=0.05),
            UserProfile(name="lax", patience=6, revert_strictness=0.7, thumbs_propensity=0.0)]


class Population(BaseModel):
    """Who the users are and what they ask. The same seed gives the same users, tasks and habits
    per session (the model's answers still vary with the server's batching)."""

    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    users: int = Field(16, ge=1)  # distinct users; each has one profile, drawn by weight
    # Sessions in flight at once (one thread each). Higher loads the server more, like more users.
    concurrency: int = Field(4, ge=1)
    split: Split = "train"
    tasks_per_family: int = Field(16, ge=1)  # tasks each family draws from
    task_seed: int = 0
    model: str = "flywheel"  # routed by the deployment; "v3" pins a version
    max_tokens: int = Field(256, ge=1)  # per request
    temperature: float = Field(1.0, ge=0, le=2)
    request_timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(2, ge=0)  # the openai client's retries (connection errors, 408/429/5xx)
    profiles: list[UserProfile] = Field(default_factory=_default_profiles, min_length=1)
    grade: GradeConfig = Field(default_factory=GradeConfig)

    @model_validator(mode="after")
    def _unique_names(self) -> Population:
        names = [p.name for p in self.profiles]
        if len(set(names)) != len(names):
            raise ValueError(f"profile names must be unique, got {names}")
        return self

    def families(self) -> list[str]:
        """Every family some profile works on, in the order first named."""
        return list(dict.fromkeys(f for p in self.profiles for f, w in p.families.items() if w > 0))


class SessionResult(BaseModel):
    """What happened in one session, as the user saw it."""

    session_id: str
    user_id: str
    profile: str
    task_id: str
    family: str
    ambiguous: bool
    completion_ids: list[str] = Field(default_factory=list)
    edit_completions: list[str] = Field(default_factory=list)  # completions whose edit ran
    kept: bool | None = None  # edits persisted (True) or reverted (False); None: no edit ran
    questions: int = 0  # answers in words only (a question or a refusal to act)
    dissatisfied: int = 0  # dissatisfied follow-ups
    invalid_tool_calls: int = 0
    tests_passed: bool | None = None  # the final workspace against the hidden tests; None: not known
    outcome: str = "abandoned"
    latencies_ms: list[float] = Field(default_factory=list)  # per request, as the client waited
    error: str = ""  # why the session ended early (server error, sandbox failure), if it did
    kind: str = "interactive"
    outcome_at: float | None = None  # background: when its outcome event is (or was) due


class SimStats(BaseModel):
    """Counts over a run. `persisted`/`reverted` count completions; `edits` completions whose edit ran."""

    sessions: int
    completions: int
    edits: int
    persisted: int
    reverted: int
    dissatisfied: int
    questions: int
    invalid_tool_calls: int
    server_errors: int  # sessions ended by an error answer (or a sandbox failure)
    tests_passed: int  # sessions whose final workspace passed
    outcomes: dict[str, int]
    latency_ms_mean: float
    latency_ms_p50: float
    latency_ms_p95: float
    wall_s: float
    events: dict[str, int]  # the EventClient's counters: emitted, accepted, duplicate, rejected, ...
    session_results: list[SessionResult]

    @classmethod
    def of(cls, results: Sequence[SessionResult], wall_s: float, events: dict[str, int]) -> SimStats:
        latencies = sorted(x for r in results for x in r.latencies_ms)

        def pct(q: float) -> float:
            return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

        return cls(
            sessions=len(results), completions=sum(len(r.completion_ids) for r in results),
            edits=sum(len(r.edit_completions) for r in results),
            persisted=sum(len(r.edit_completions) for r in results if r.kept is True),
            reverted=sum(len(r.edit_completions) for r in results if r.kept is False),
            dissatisfied=sum(r.dissatisfied for r in results), questions=sum(r.questions for r in results),
            invalid_tool_calls=sum(r.invalid_tool_calls for r in results),
            server_errors=sum(bool(r.error) for r in results),
            tests_passed=sum(r.tests_passed is True for r in results),
            outcomes=dict(Counter(r.outcome for r in results)),
            latency_ms_mean=statistics.fmean(latencies) if latencies else 0.0,
            latency_ms_p50=pct(0.5), latency_ms_p95=pct(0.95), wall_s=wall_s, events=events,
            session_results=list(results),
        )


class _ServerError(Exception):
    """The server answered with an error, or with something that is not a chat completion."""


@dataclass
class _Answer:
    completion_id: str
    message: dict[str, Any]  # the assistant turn as it goes back into the next request
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    # calls the model wrote that no client could dispatch: the server sends them as text and counts
    # them in its `flywheel` field (each is an invalid call in the store, with its penalty)
    invalid_as_text: int = 0


def _tool_call(raw: Any, index: int, completion_id: str) -> ToolCall:
    """An OpenAI tool call as flywheel's ToolCall; whatever is wrong with it becomes its error."""
    function = getattr(raw, "function", None)
    name = getattr(function, "name", None)
    name = name if isinstance(name, str) and name else "?"
    call_id = getattr(raw, "id", None) or f"{completion_id}-call-{index}"
    error = (getattr(raw, "model_extra", None) or {}).get("error")  # the server's reason, when it parsed badly
    arguments: Any = getattr(function, "arguments", None)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            error = error or "arguments are not JSON"
    if not isinstance(arguments, dict):
        error = error or "arguments must be a JSON object"
        arguments = {}
    error = error if isinstance(error, str) and error else validate_arguments(name, arguments)
    return ToolCall(call_id, name, arguments, error=error)


def _read_answer(response: Any) -> _Answer:
    choices = getattr(response, "choices", None)
    message = getattr(choices[0], "message", None) if choices else None
    completion_id = getattr(response, "id", None)
    if message is None or not isinstance(completion_id, str) or not completion_id:
        raise _ServerError(f"not a chat completion (no id or no message): {str(response)[:200]}")
    content = message.content if isinstance(message.content, str) else ""
    raw_calls = list(message.tool_calls or [])
    calls = [_tool_call(raw, i, completion_id) for i, raw in enumerate(raw_calls)]
    echoed: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        echoed["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _raw_arguments(raw, call)}}
            for raw, call in zip(raw_calls, calls, strict=True)]
    served = (getattr(response, "model_extra", None) or {}).get("flywheel") or {}
    invalid = served.get("invalid_tool_calls", 0) if isinstance(served, dict) else 0
    return _Answer(completion_id, echoed, content, calls, invalid if isinstance(invalid, int) else 0)


def _raw_arguments(raw: Any, call: ToolCall) -> str:
    """The arguments as the server sent them (a string), so the next prompt shows what the model wrote."""
    arguments = getattr(getattr(raw, "function", None), "arguments", None)
    return arguments if isinstance(arguments, str) else json.dumps(call.arguments)


class SimulatedUser:
    """One user with one profile; `run_session` plays one task against the server. Thread-safe: the
    openai client and the EventClient are shared, everything else is per session."""

    def __init__(self, user_id: str, profile: UserProfile, api: openai.OpenAI, events: EventClient,
                 pool: SandboxPool, population: Population, deferred: list[DeferredEvent] | None = None):
        self.user_id, self.profile, self.api, self.events = user_id, profile, api, events
        self.pool, self.population, self.deferred = pool, population, deferred

    def run_session(self, session_id: str, task: Task, rng: random.Random,
                    words: random.Random | None = None) -> SessionResult:
        """`words` draws the follow-ups' wording (default: seeded by the session id), apart from `rng`
        so that what the user does does not depend on how they phrase it."""
        words = words or random.Random(f"{session_id}:words")
        result = SessionResult(session_id=session_id, user_id=self.user_id, profile=self.profile.name,
                               task_id=task.id, family=task.family, ambiguous=task.metadata.ambiguous)
        finished = False
        verdicts: dict[str, bool] = {}  # workspace digest -> passes: a finish and the end grade once
        try:
            box = self.pool.acquire(task.files)
            try:
                with Toolbox(box) as tools:
                    finished = self._converse(task, tools, result, rng, verdicts, words)
                    final = box.snapshot()
            finally:
                self.pool.release(box)
            result.tests_passed = self._passes(task, final, verdicts)
        except SandboxError as exc:  # the user's machine failed, not the model: no verdict on the edits
            result.error = f"sandbox failed: {exc}"
            log.warning("session %s abandoned: %s", session_id, result.error)
        self._report(result, finished, rng)
        return result

    # ---- the conversation

    def _converse(self, task: Task, tools: Toolbox, result: SessionResult, rng: random.Random,
                  verdicts: dict[str, bool], words: random.Random) -> bool:
        """Talk until the agent is done or the user's patience ends; True if the agent called finish."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": task.instruction}]
        clarified = False
        trail = Trail()
        vague, wrong = self.profile.followup_vague_share, self.profile.followup_wrong_share
        hostile = self.profile.followup_hostile_share
        for turn in range(self.profile.patience):
            last_turn = turn + 1 == self.profile.patience
            try:
                answer = self._ask(task, messages, result, rng)
            except _ServerError as exc:
                result.error = str(exc)
                log.warning("session %s abandoned after a server error: %s", result.session_id, exc)
                return False
            messages.append(answer.message)
            result.invalid_tool_calls += answer.invalid_as_text
            trail.saw([], [], answer.invalid_as_text)
            if not answer.calls and self.profile.kind == "background":
                result.questions += bool(answer.content.strip())  # no user to answer: no event
                messages.append({"role": "user", "content": WORK_ALONE})
                continue
            if not answer.calls:
                result.questions += bool(answer.content.strip())
                needed = task.metadata.ambiguous and not clarified and bool(answer.content.strip())
                clarified = clarified or needed
                # A needless question, or no answer at all: the user always says so.
                text = (task.answer_question(answer.content) if needed
                        else maybe_hostile(words_for_needless_question(answer.content, words, vague, wrong), words,
                                           hostile))
                self.events.followup(result.session_id, answer.completion_id, dissatisfied=not needed, text=text)
                result.dissatisfied += not needed
                messages.append({"role": "user", "content": text})
                continue
            outputs = tools.execute(answer.calls)
            trail.saw(answer.calls, [out.ok for out in outputs])
            result.invalid_tool_calls += sum(not c.valid for c in answer.calls)
            if any(out.ok and out.name in EDIT_TOOLS for out in outputs):
                result.edit_completions.append(answer.completion_id)
                if self.profile.kind == "interactive":  # a background agent edits its own workspace: no editor event
                    self._emit(EventType.EDIT_APPLIED, result, answer.completion_id)
            messages += [{"role": "tool", "tool_call_id": call.id, "content": out.content}
                         for call, out in zip(answer.calls, outputs, strict=True)]
            if any(c.valid and c.name == "finish" for c in answer.calls):
                if self.profile.kind == "background":
                    return True  # judged at the end, hours later
                if self._passes(task, tools.sandbox.snapshot(), verdicts):
                    return True
                if last_turn or rng.random() >= self.profile.followup_propensity:
                    return True
                text = maybe_hostile(words_for_failing_tests(task, trail, words, vague, wrong), words, hostile)
                self.events.followup(result.session_id, answer.completion_id, dissatisfied=True, text=text)
                result.dissatisfied += 1
                messages.append({"role": "user", "content": text})
        return False

    def _ask(self, task: Task, messages: list[dict[str, Any]], result: SessionResult, rng: random.Random) -> _Answer:
        low, high = self.profile.think_time_s
        if high > 0:
            time.sleep(rng.uniform(low, high))
        meta = {"family": task.family, "ambiguous": task.metadata.ambiguous, "task_id": task.id,
                "difficulty": task.metadata.difficulty, "profile": self.profile.name}
        if self.profile.kind == "background":
            meta["session_kind"] = "background"
        if self.profile.org_id:
            meta["org_id"] = self.profile.org_id
        started = time.perf_counter()
        try:
            response = self.api.chat.completions.create(
                model=self.population.model, messages=messages, tools=tool_schemas(),
                max_tokens=self.population.max_tokens, temperature=self.population.temperature,
                user=self.user_id, metadata=meta, extra_body={"session_id": result.session_id})
        except openai.APIError as exc:  # an error status, a timeout, a body the client cannot read
            raise _ServerError(f"{type(exc).__name__}: {exc}") from None
        result.latencies_ms.append((time.perf_counter() - started) * 1000)
        answer = _read_answer(response)
        result.completion_ids.append(answer.completion_id)
        return answer

    # ---- the verdict

    def _passes(self, task: Task, workspace: Snapshot, verdicts: dict[str, bool]) -> bool:
        if dict(workspace.files) == {p: t.encode() for p, t in task.files.items()}:
            return False  # untouched: every task fails its hidden tests as generated
        digest = hashlib.sha256()
        for path, data in sorted(workspace.files.items()):
            digest.update(f"{path}\0{len(data)}\0".encode() + data)
        key = digest.hexdigest()
        if key not in verdicts:
            verdicts[key] = grade(task, workspace, self.population.grade, self.pool.config.sandbox).all_passed
        return verdicts[key]

    def _report(self, result: SessionResult, finished: bool, rng: random.Random) -> None:
        if not result.completion_ids:
            return  # the server never answered: there is nothing to give feedback on
        if self.profile.kind == "background":
            self._judge(result, rng)
            return
        passed = result.tests_passed
        if passed is not None and result.edit_completions:
            result.kept = passed or rng.random() >= self.profile.revert_strictness
            kind = EventType.EDIT_PERSISTED if result.kept else EventType.EDIT_REVERTED
            for completion_id in result.edit_completions:
                self._emit(kind, result, completion_id, {"tests_passed": passed})
        if passed:
            result.outcome = "success"
        elif finished and passed is not None:
            result.outcome = "unhappy"
        else:
            result.outcome = "abandoned"
        if passed is not None and rng.random() < self.profile.thumbs_propensity:
            self._emit(EventType.THUMBS, result, result.completion_ids[-1], {"up": passed})
        outcome: dict[str, Any] = {"outcome": result.outcome}
        if passed is not None:
            outcome["tests_passed"] = passed
        self._emit(EventType.SESSION_END, result, None, outcome)

    def _judge(self, result: SessionResult, rng: random.Random) -> None:
        """A background session's one outcome, due hours after its end (module docstring)."""
        result.kind = "background"
        if result.tests_passed:
            result.outcome = rng.choice(("merged", "ci_green"))
        else:
            result.outcome = "reverted" if result.edit_completions else "abandoned"
        result.kept = None if not result.edit_completions else bool(result.tests_passed)
        result.outcome_at = time.time() + rng.uniform(*self.profile.outcome_delay_s)
        payload: dict[str, Any] = {"outcome": result.outcome}
        if result.tests_passed is not None:
            payload["tests_passed"] = result.tests_passed
        event = {"type": EventType.OUTCOME, "session_id": result.session_id, "payload": payload,
                 "at": result.outcome_at}
        if self.deferred is not None:
            self.deferred.append(DeferredEvent(result.outcome_at, event))
        else:
            self.events.emit(**event)

    def _emit(self, kind: EventType, result: SessionResult, completion_id: str | None,
              payload: dict[str, Any] | None = None) -> None:
        self.events.emit(kind, session_id=result.session_id, completion_id=completion_id, payload=payload)


@dataclass(frozen=True)
class DeferredEvent:
    """An event a simulated user will send at `due` (simulated time): `EventClient.emit(**kwargs)`."""

    due: float
    kwargs: dict[str, Any]


def release_due(deferred: list[DeferredEvent], events: EventClient, now: float) -> int:
    """Send the deferred events due by `now` (removed from `deferred`); returns how many."""
    due = [d for d in deferred if d.due <= now]
    for d in sorted(due, key=lambda d: d.due):
        events.emit(**d.kwargs)
        deferred.remove(d)
    return len(due)


@dataclass(frozen=True)
class PlannedSession:
    index: int
    user: int  # which of the population's users
    profile: UserProfile
    task: Task


def plan_sessions(population: Population, n_sessions: int, tasks: Sequence[Task] | None = None) -> list[PlannedSession]:
    """Who works on what in each session: a function of the seed only, not of thread timing.

    Session i draws its user, then a family from that user's mix and a task of it (in the user's
    organization's codebase when its profile has house rules); with `tasks` given, session i works
    on tasks[i % len(tasks)] instead (a fixed workload)."""
    if n_sessions < 0:
        raise ValueError(f"n_sessions must be >= 0, got {n_sessions}")
    if tasks is not None and not tasks:
        raise ValueError("tasks is empty; pass None to draw tasks from the profiles' families")
    profiles = [random.Random(f"{population.seed}:user:{k}").choices(
        population.profiles, weights=[p.weight for p in population.profiles])[0] for k in range(population.users)]
    workload = {f: generate(f, population.split, population.tasks_per_family, population.task_seed)
                for f in population.families()} if tasks is None else {}
    plan = []
    for i in range(n_sessions):
        rng = random.Random(f"{population.seed}:plan:{i}")
        user = rng.randrange(population.users)
        profile = profiles[user]
        if tasks is not None:
            task = tasks[i % len(tasks)]
        else:
            families = [f for f, w in profile.families.items() if w > 0]
            family = rng.choices(families, weights=[profile.families[f] for f in families])[0]
            task = rng.choice(workload[family])
            if profile.house_rules is not None:
                task = profile.house_rules.adapt(task)  # the same bug, in the organization's codebase
        plan.append(PlannedSession(i, user, profile, task))
    return plan


def run_population(base_url: str, api_key: str, population: Population, n_sessions: int, pool: SandboxPool,
                   events_key: str | None = None, events: EventClient | None = None,
                   tasks: Sequence[Task] | None = None, session_prefix: str | None = None,
                   deferred: list[DeferredEvent] | None = None) -> SimStats:
    """Run `n_sessions` sessions (`plan_sessions`), `population.concurrency` at a time, against `base_url`.

    `api_key` needs the inference scope; events go with `events_key` (default: `api_key`) through a
    new EventClient that is flushed and closed before this returns, so `stats.events` is final; or
    through `events` (flushed, left open). Session ids are `{session_prefix}-{i}`, the prefix random
    by default so that runs against one store never share a session. With `deferred`, background
    sessions' outcomes are appended there instead of sent (`release_due` sends them later).
    """
    started = time.perf_counter()
    plan = plan_sessions(population, n_sessions, tasks)
    prefix = session_prefix or f"sim-{uuid.uuid4().hex[:8]}"
    api = openai.OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key=api_key, timeout=population.request_timeout_s,
                        max_retries=population.max_retries)
    client = events or EventClient(base_url, events_key or api_key)

    def session(planned: PlannedSession) -> SessionResult:
        user = SimulatedUser(f"{planned.profile.name}-{planned.user}", planned.profile, api, client, pool, population,
                             deferred)
        rng = random.Random(f"{population.seed}:session:{planned.index}")
        words = random.Random(f"{population.seed}:words:{planned.index}")
        return user.run_session(f"{prefix}-{planned.index}", planned.task, rng, words)

    try:
        with ThreadPoolExecutor(population.concurrency, thread_name_prefix="sim-user") as executor:
            results = list(executor.map(session, plan))
    finally:
        if events is None:
            client.close()
        else:
            client.flush()
        api.close()
    stats = client.stats
    counters = {name: getattr(stats, name) for name in
                ("emitted", "accepted", "duplicate", "rejected", "dropped", "failed", "retries", "queued")}
    return SimStats.of(results, time.perf_counter() - started, counters)
